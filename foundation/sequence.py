"""One sequence's token ids and their rules: appended to, or rolled back to an absolute
length. Every holder of committed tokens (the target's and the draft's sessions, the
orchestrator's session record) keeps them in a `TokenSequence`, so a rollback means the
same everywhere: a repeated one is harmless. (What a holder must keep, such as a target
session's first token, is that holder's own check.)"""

from __future__ import annotations

from collections.abc import Sequence

from foundation.errors import InvalidArgument


class TokenSequence:
    def __init__(self, token_ids: Sequence[int] = ()):
        self._ids = [int(t) for t in token_ids]

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def ids(self) -> list[int]:
        """The token ids themselves, not a copy: read them, change them only through
        append and truncate_to."""
        return self._ids

    @property
    def last_token_id(self) -> int:
        return self._ids[-1]

    def append(self, token_ids: Sequence[int]) -> None:
        self._ids.extend(int(t) for t in token_ids)

    def truncate_to(self, length: int) -> None:
        """Keeps the first `length` tokens: an absolute length, so a rollback repeated
        (a retried call, a verdict applied twice) changes nothing more."""
        if not 0 <= length <= len(self._ids):
            raise InvalidArgument(f"cannot truncate a {len(self._ids)}-token sequence to {length}")
        del self._ids[length:]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
