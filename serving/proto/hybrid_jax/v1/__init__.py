"""Proto package `hybrid_jax.v1`: messages (`generation_pb2`) and the `Generation` stub/servicer."""

from serving.proto.hybrid_jax.v1 import generation_pb2, generation_pb2_grpc

__all__ = ["generation_pb2", "generation_pb2_grpc"]
