"""The public API's bounds on one request, each an OrchestratorConfig setting: a request
past one is refused with INVALID_ARGUMENT naming the setting and its value, before any
worker is touched. (Bounds on calls and sessions per caller: service_common/limits.py
and the servicer.)"""

from __future__ import annotations

from foundation.errors import InvalidArgument, ResourceExhausted


def check_prompt_tokens(config, num_tokens: int) -> None:
    """num_tokens: the prompt as the target will hold it, a continued session's history included."""
    if config.max_prompt_tokens and num_tokens > config.max_prompt_tokens:
        raise InvalidArgument(
            f"prompt of {num_tokens} tokens is above the limit of {config.max_prompt_tokens} tokens "
            f"(max_prompt_tokens; a continued session's history counts)"
        )


def check_max_new_tokens(config, max_new_tokens: int) -> None:
    if config.max_new_tokens_limit and max_new_tokens > config.max_new_tokens_limit:
        raise InvalidArgument(
            f"max_new_tokens {max_new_tokens} is above the limit of {config.max_new_tokens_limit} "
            f"(max_new_tokens_limit)"
        )


def check_session_quota(config, store, owner: str) -> None:
    """Before a new session of owner is made; only named callers (API keys) are counted."""
    if not owner or not config.max_sessions_per_key:
        return
    held = store.count_owned(owner)
    if held >= config.max_sessions_per_key:
        raise ResourceExhausted(
            f"API key {owner!r} holds {held} sessions, its limit (max_sessions_per_key="
            f"{config.max_sessions_per_key}); close some (CloseSession) or let them expire"
        )
