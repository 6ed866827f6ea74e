"""The OpenAI-compatible HTTP API: protocol models, chat templates, handlers, the server."""
