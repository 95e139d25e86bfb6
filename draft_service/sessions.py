"""A draft session as the worker's SessionCache (service_common.session_cache) holds it.

A Speculate call holds its session's lock for all its rounds; a Truncate sent right
after cancelling one waits for the round in flight, then finds a consistent session.
The cache never evicts a session in use (`evicts_in_use=False`): a Speculate stream
cannot be cut short. An evicted session is gone: its owner opens it again from the
committed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from service_common.session_cache import CachedSession
from speculative.drafter_base import DraftSession
from speculative.policy import AdaptiveK


@dataclass(eq=False)
class SessionEntry(CachedSession):
    drafter: str  # name of the session's drafter: "model", "ngram" or "ngram+model"
    draft: DraftSession
    next_round: int = 0  # Proposal.round of the session's next round (0-based per session)
    # The last adaptive call's policy: the next call (the next turn) goes on with what it measured.
    policy: AdaptiveK | None = None

    @property
    def length(self) -> int:
        """Committed tokens, in tokens (no call holds unverified drafts between rounds)."""
        return self.draft.length

    def release(self) -> None:
        self.draft.release()
