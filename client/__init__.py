"""A command-line client of the orchestrator's public API."""
