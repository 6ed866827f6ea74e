"""The gRPC API of hybrid-jax: `generation.proto` and its committed Python stubs.

    from serving.proto.hybrid_jax.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc

Regenerate the stubs with `serving/proto/generate.sh` after editing the .proto.
This package holds only the wire format; it knows nothing of the engine.
"""
