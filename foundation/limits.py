"""Limits of the speculation protocol, shared by every service and the report.

Free of torch on purpose: the trace report and the orchestrator's request checks read
them without loading a model runtime.
"""

from __future__ import annotations

from foundation.errors import InvalidArgument

# Speculation length beyond this costs more in verification than any realistic draft
# recovers (acceptance decays geometrically with position), and keeps proposals small.
MAX_SPECULATIVE_TOKENS = 16
# Continuations one token tree may hold (SGLang's n-gram trees go to breadth 10): a
# tree of MAX_TREE_WIDTH paths of MAX_SPECULATIVE_TOKENS tokens bounds one pass's width.
MAX_TREE_WIDTH = 8
MAX_TREE_NODES = MAX_TREE_WIDTH * MAX_SPECULATIVE_TOKENS


def validate_num_speculative_tokens(k: int) -> int:
    if not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise InvalidArgument(
            f"num_speculative_tokens (k) must be in [0, {MAX_SPECULATIVE_TOKENS}] "
            f"(0 = target-only decoding), got {k}"
        )
    return k
