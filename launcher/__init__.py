"""Starts the whole system locally as separate processes: target, draft, orchestrator."""
