"""The OpenAI-compatible HTTP API: a second frontend in the serve process, beside the ZMQ ROUTER (docs/http.md)."""
