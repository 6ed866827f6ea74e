"""Entry points, which depend on the engine and never the reverse: the Python `LLM`
API, the CLI (`hybrid-jax generate | serve | bench | train`), the gRPC server and
client (grpc/), request validation and limits, metrics, request logs, Hub lookup and
the serving benchmark (bench/)."""
