"""The Python API, familiar to vLLM users.

    from serving import LLM, SamplingParams
    llm = LLM()                                         # the shipped default model
    llm = LLM(model="native-tiny")                      # HF dir, native dir or preset
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
    outs = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams())
    for delta in llm.stream("Hello", SamplingParams(max_tokens=8)): print(delta.text, end="")

Outputs come back in input order. This module drives the engine synchronously in
the caller's thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from configs import DEFAULT_MODEL
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.engine.outputs import RequestDelta, RequestOutput
from serving.sample.sampling_params import SamplingParams

Params = SamplingParams | Sequence[SamplingParams] | None


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, *, dtype: str = "float32", seed: int = 0,
                 show_progress: bool = True, **engine_kwargs):
        self.engine = LLMEngine(model, EngineConfig(dtype=dtype, **engine_kwargs), seed=seed,
                                show_progress=show_progress)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine built elsewhere (from a LoadedModel, or shared by tests).

        The LLM then drives `engine` synchronously; nothing else may step it meanwhile.
        """
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def generate(self, prompts: str | Sequence[str] | None = None, sampling_params: Params = None,
                 *, prompt_token_ids: Sequence[Sequence[int]] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts or prompt_token_ids")
        n = len(prompts) if prompts is not None else len(prompt_token_ids)
        params = _per_request(sampling_params, n)
        outputs: dict[str, RequestOutput] = {}
        order = []
        try:
            for i in range(n):
                text = prompts[i] if prompts is not None else None
                ids = list(prompt_token_ids[i]) if prompt_token_ids is not None else None
                rid = self.engine.add_request(text, params[i], prompt_token_ids=ids)
                seq = self.engine.requests[rid].seq
                outputs[rid] = RequestOutput(rid, text, seq.prompt_token_ids)
                order.append(rid)
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    if delta.request_id in outputs:
                        outputs[delta.request_id].add(delta)
        except BaseException:
            for rid in order:
                self.engine.abort(rid)
            raise
        return [outputs[rid] for rid in order]

    def stream(self, prompt: str | None = None, sampling_params: SamplingParams | None = None, *,
               prompt_token_ids: Sequence[int] | None = None) -> Iterator[RequestDelta]:
        """Yield one request's deltas as they are produced (the last has finished=True)."""
        rid = self.engine.add_request(prompt, sampling_params,
                                      prompt_token_ids=list(prompt_token_ids) if prompt_token_ids else None)
        try:
            while True:
                for delta in self.engine.step():
                    if delta.request_id == rid:
                        yield delta
                        if delta.finished:
                            return
        finally:
            self.engine.abort(rid)


def _per_request(params: Params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if len(params) != n:
        raise ValueError(f"sampling_params: {len(params)} given for {n} prompts")
    return list(params)
