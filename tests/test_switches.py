"""configs/switches.py is the one reader of `HYBRID_JAX_*` variables: its table equals
docs/switches.md's, no other module reads one, and malformed values are refused naming
the variable."""

import re
from pathlib import Path

import pytest

from configs import switches

ROOT = Path(__file__).resolve().parents[1]
# An environment read whose argument names a HYBRID_JAX_ variable (os.environ.get / [...] /
# getenv), or a scan of the environment for the prefix.
READ = re.compile(r"(environ(\.get)?\s*[\(\[]\s*f?[\"']HYBRID_JAX_|getenv\(\s*f?[\"']HYBRID_JAX_"
                  r"|startswith\(\s*[\"']HYBRID_JAX_)")


def test_docs_table_is_the_module_table():
    text = (ROOT / "docs" / "switches.md").read_text()
    table = text.split("| variable | default | meaning |")[1].split("\n\n")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.strip().splitlines()[1:]]
    assert [(r[0].strip("`"), r[1]) for r in rows] == [(s.name, s.default) for s in switches.SWITCHES]
    assert len({s.name for s in switches.SWITCHES}) == len(switches.SWITCHES)


def test_no_other_module_reads_a_switch():
    offenders = []
    for package in ("configs", "hybrid_jax", "pallas_kernels", "serving", "benchmarks"):
        for path in (ROOT / package).rglob("*.py"):
            if path == ROOT / "configs" / "switches.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if READ.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_pattern_finds_a_read():  # the scan above must be able to fail
    assert READ.search('x = os.environ.get("HYBRID_JAX_DECODE_GLUE", "1")')
    assert READ.search("os.environ['HYBRID_JAX_X']")
    assert not READ.search('switches.decode_glue()  # HYBRID_JAX_DECODE_GLUE=0: off')


def test_defaults_and_bad_values(monkeypatch):
    for name in ("HYBRID_JAX_PARALLEL_DECODE_ROWS", "HYBRID_JAX_FOLD_CONV_ROWS", "HYBRID_JAX_DECODE_GLUE",
                 "HYBRID_JAX_FUSE_PROJECTIONS", "HYBRID_JAX_STREAM_GEMM_CONFIG",
                 "HYBRID_JAX_MOE_FEW_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    assert (switches.parallel_decode_rows(), switches.fold_conv_rows()) == (128, 8)
    assert switches.decode_glue() and switches.fuse_projections() and switches.stream_gemm_config() is None
    assert switches.moe_few_config() is None
    monkeypatch.setenv("HYBRID_JAX_MOE_FEW_CONFIG", "32,128,4,6,4")
    assert switches.moe_few_config() == (32, 128, 4, 6, 4)
    from pallas_kernels.grouped_gemm import moe_config
    assert (moe_config(8).bn, moe_config(8).splits, moe_config(64).splits) == (32, 4, 1)
    monkeypatch.delenv("HYBRID_JAX_MOE_FEW_CONFIG")
    fp8 = (moe_config(8, fp8=True).splits, moe_config(64, fp8=True).splits)
    assert (moe_config(8).splits, *fp8) == (1, 4, 1)
    monkeypatch.setenv("HYBRID_JAX_MOE_FEW_CONFIG", "32,128")
    with pytest.raises(ValueError, match="HYBRID_JAX_MOE_FEW_CONFIG"):
        switches.moe_few_config()
    monkeypatch.setenv("HYBRID_JAX_FOLD_CONV_ROWS", "0")
    assert switches.fold_conv_rows() == 0
    monkeypatch.setenv("HYBRID_JAX_DECODE_GLUE", "0")
    assert not switches.decode_glue()
    for bad in ("eight", "-1", ""):
        monkeypatch.setenv("HYBRID_JAX_FOLD_CONV_ROWS", bad)
        with pytest.raises(ValueError, match="HYBRID_JAX_FOLD_CONV_ROWS"):
            switches.fold_conv_rows()


def test_every_compile_switch_keys_the_executable_store(monkeypatch):
    """A switch that changes what the engine compiles must be in the store's key whatever
    its name holds (a word rule once dropped HYBRID_JAX_SINGLE_TOKEN_ROWS as a "TOKEN")."""
    from configs import switches

    secret = {"HYBRID_JAX_API_KEY", "HYBRID_JAX_DEBUG", "HYBRID_JAX_EXECUTABLE_STORE",
              "HYBRID_JAX_EXECUTABLE_STORE_MAX_GB", "HYBRID_JAX_PROFILE_DEVICE"}
    for s in switches.SWITCHES:
        monkeypatch.setenv(s.name, "0")
    monkeypatch.setenv("HYBRID_JAX_MY_TOKEN", "x")  # unknown: kept out if it looks secret
    monkeypatch.setenv("HYBRID_JAX_MY_EXPERIMENT", "1")  # unknown: keyed
    mine = {s.name for s in switches.SWITCHES} | {"HYBRID_JAX_MY_TOKEN", "HYBRID_JAX_MY_EXPERIMENT"}
    keyed = {k for k, _ in switches.keyed_environment()} & mine
    assert keyed == {s.name for s in switches.SWITCHES} - secret | {"HYBRID_JAX_MY_EXPERIMENT"}
