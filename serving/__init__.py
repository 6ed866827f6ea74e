"""hybrid-jax serving engine.

Host-side bookkeeping (scheduler, pools, sequences, sampling parameters) is plain
Python and imports no JAX; the runner, the engine and the LLM API build on it.
`LLM` and `LLMEngine` are imported lazily so that `import serving.core.scheduler` stays
free of JAX.
"""

from serving.core.scheduler import Scheduler, SchedulerStats, StepOutput
from serving.core.scheduler_config import AttentionGroup, SchedulerConfig
from serving.core.sequence import FinishReason, Sequence, SequenceStatus
from serving.sample.sampling_params import SamplingParams


def __getattr__(name: str):
    if name == "LLM":
        from serving.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from serving.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = [
    "LLM",
    "LLMEngine",
    "AttentionGroup",
    "FinishReason",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "Sequence",
    "SequenceStatus",
    "StepOutput",
]
