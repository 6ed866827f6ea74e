#!/usr/bin/env bash
# Regenerate the committed Python stubs from generation.proto (needs grpcio-tools).
# The proto is compiled relative to the repository root, so the generated imports
# read `from serving.proto.hybrid_jax.v1 import generation_pb2` and work from an install.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
python -m grpc_tools.protoc -I . \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  serving/proto/hybrid_jax/v1/generation.proto
