"""The gRPC front: the `Generate` service over an `EngineCore`, the server (health,
reflection, TLS and API keys) and a small client."""
