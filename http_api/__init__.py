"""The OpenAI-compatible HTTP API and the playground: a role of its own in front of the orchestrator's gRPC API."""
