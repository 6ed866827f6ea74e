"""Shared fixtures of the gRPC server tests: one small engine for the whole session.

Compiling an engine takes seconds on CPU, so every in-process server test module
builds its `GenerationServer` (and its own EngineCore) over this one engine; a
module's server is shut down when the module ends, so only one core steps it.
"""

from __future__ import annotations

import pytest

from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine

SERVER_CFG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=16,
                          max_model_len=128, page_size=8)


@pytest.fixture(scope="session")
def server_engine() -> LLMEngine:
    return LLMEngine("native-tiny", SERVER_CFG, show_progress=False)
