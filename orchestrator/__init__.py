"""The public API and control plane: sessions, worker choice, rollback, tokenization."""
