"""The step executables' XLA options (GPU): what is switched off, and the override."""

from __future__ import annotations

from serving.runner.step_fns import compile_options


def test_defaults_turn_off_dot_merger_and_triton_gemms(monkeypatch):
    monkeypatch.delenv("HYBRID_JAX_XLA_OPTIONS", raising=False)
    opts = compile_options()
    # The pass name has a hyphen (XLA ignores unknown names silently).
    assert opts["xla_disable_hlo_passes"] == "dot-merger"
    assert opts["xla_gpu_enable_triton_gemm"] is False


def test_environment_adds_overrides_and_removes(monkeypatch):
    monkeypatch.setenv("HYBRID_JAX_XLA_OPTIONS",
                       '{"xla_gpu_enable_triton_gemm": true, "xla_disable_hlo_passes": null, "x": 1}')
    opts = compile_options()
    assert opts["xla_gpu_enable_triton_gemm"] is True and opts["x"] == 1
    assert "xla_disable_hlo_passes" not in opts
