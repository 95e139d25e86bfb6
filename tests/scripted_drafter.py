"""Test drafters: one that knows the right answer and lies on purpose, to force partial
acceptance; a wrapper that counts proposals."""

from __future__ import annotations

from collections.abc import Sequence

from model_runtime.fingerprint import ANY_VOCABULARY
from speculative.drafter_base import Drafter, DraftSession, Proposal
from speculative.sampling import SamplingParams


class ScriptedDrafter(Drafter):
    """Proposes the reference continuation, wrong from draft position `num_correct` on.

    reference: the full expected sequence (prompt + target-only greedy output).
    """

    def __init__(self, reference: Sequence[int], num_correct: int, vocab_size: int):
        self.reference = list(reference)
        self.num_correct = num_correct
        self.vocab_size = vocab_size
        self.name = f"scripted:{num_correct}"
        self.fingerprint = ANY_VOCABULARY

    def open(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> DraftSession:
        return ScriptedDraftSession(self, list(prompt_token_ids))


class ScriptedDraftSession(DraftSession):
    def __init__(self, drafter: ScriptedDrafter, token_ids: list[int]):
        self.drafter = drafter
        self.token_ids = token_ids

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def propose(self, k: int, min_reach: float = 0.0) -> Proposal:
        assert self.token_ids == self.drafter.reference[: self.length], (
            "session drifted from the reference"
        )
        truth = self.drafter.reference[self.length : self.length + k]
        proposal = [
            token if position < self.drafter.num_correct else (token + 1) % self.drafter.vocab_size
            for position, token in enumerate(truth)
        ]
        self.token_ids += proposal
        return Proposal(proposal)

    def append(self, token_ids: Sequence[int]) -> None:
        self.token_ids += token_ids

    def truncate_to(self, length: int) -> None:
        del self.token_ids[length:]


def counting_proposals(drafter: Drafter) -> Drafter:
    """The drafter, counting in `drafter.proposals` the non-empty proposals its sessions
    made (to check that a test ran the path it is about)."""
    drafter.proposals = 0
    open_session = drafter.open

    def open_counted(prompt_token_ids, params):
        session = open_session(prompt_token_ids, params)
        propose = session.propose

        def propose_counted(k, min_reach=0.0):
            proposal = propose(k, min_reach)
            drafter.proposals += bool(proposal)
            return proposal

        session.propose = propose_counted
        return session

    drafter.open = open_counted
    return drafter
