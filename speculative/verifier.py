"""The target as the round loop sees it: proposals sent, verdicts received in order (`generator.LocalVerifier`,
`draft_service.remote_verifier.RemoteVerifier`). Free of torch: the n-gram draft worker runs the loop without it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from speculative.types import VerifyResult

if TYPE_CHECKING:
    from speculative.prompt_lookup import LookupRounds, LookupStop
    from speculative.sampling import SparseProbs


class Verifier(Protocol):
    overlaps: bool  # the target verifies while the loop drafts: only then does drafting ahead pay
    runs_lookup: (
        bool  # the target can run prompt lookup's rounds in a stretch: a round trip less per round
    )

    def send(
        self,
        base_len: int,
        draft_token_ids: Sequence[int],
        draft_probs: Sequence[SparseProbs] | None,
        expected_last_token_id: int | None = None,
        parents: Sequence[int] | None = None,
    ) -> None:
        """Sends a proposal; expected_last_token_id: the token it assumes at base_len - 1; parents: a
        token tree's (speculative.token_tree), None for a chain."""

    def receive(self) -> VerifyResult:
        """The verdict on the oldest proposal not yet received (skipping abandoned ones); StaleProposal if stale."""

    def verdict_came(self) -> bool:
        """Whether that verdict is in (no wait)."""

    def abandon_last(self) -> None:
        """The proposal sent last will be discarded (its context turned out wrong): its
        verdict is skipped, and RuntimeError raised should the target apply it."""

    def decode(
        self,
        base_len: int,
        max_tokens: int,
        until: LookupStop | None = None,
        lookup: LookupRounds | None = None,
    ) -> Iterator[VerifyResult]:
        """A stretch: target-only decoding of up to max_tokens tokens, one result per pass, ending after a
        stop token or the first token at which prompt lookup with `until`'s sizes finds text to copy; with
        `lookup`, each pass also verifies what prompt lookup finds. Nothing may be in flight."""
