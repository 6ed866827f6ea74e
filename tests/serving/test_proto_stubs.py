"""The committed gRPC stubs are what generation.proto compiles to, and import as a package."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTO = "serving/proto/hybrid_jax/v1/generation.proto"
STUBS = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")
# The generator's own version, stamped into the stubs (and the oldest runtime they accept):
# a newer grpcio-tools than the one that made the committed stubs (1.85.1, the minimum the
# package requires) changes only these, so they are compared apart from the rest.
VERSION_LINES = re.compile(r"^GRPC_GENERATED_VERSION = .*$|^# Protobuf Python Version: .*$|"
                           r"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)", re.M)


def _without_versions(text: str) -> str:
    return VERSION_LINES.sub("<version>", text)


def test_committed_stubs_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    (tmp_path / Path(PROTO).parent).mkdir(parents=True)
    shutil.copy(ROOT / PROTO, tmp_path / PROTO)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.",
                    "--pyi_out=.", "--grpc_python_out=.", PROTO], cwd=tmp_path, check=True)
    for name in STUBS:
        fresh = (tmp_path / Path(PROTO).parent / name).read_text()
        committed = (ROOT / Path(PROTO).parent / name).read_text()
        assert _without_versions(fresh) == _without_versions(committed), (
            f"{name} is stale: run serving/proto/generate.sh")
    # The committed stubs accept the oldest grpcio the package requires.
    grpc_stub = (ROOT / Path(PROTO).parent / "generation_pb2_grpc.py").read_text()
    assert "GRPC_GENERATED_VERSION = '1.85.1'" in grpc_stub


def test_stubs_import_as_a_package_and_name_the_service():
    from serving.proto.hybrid_jax.v1 import generation_pb2, generation_pb2_grpc

    service = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert service.full_name == "hybrid_jax.v1.Generation"
    assert {m.name for m in service.methods} == {"Generate", "Tokenize", "Detokenize", "GetModelInfo"}
    assert service.methods_by_name["Generate"].server_streaming
    assert hasattr(generation_pb2_grpc, "GenerationStub")
