"""Which half of a lookup-then-model cascade proposes (prompt_lookup.LookupThenModelSession).

Prompt lookup is free; the draft model's k tokens cost a share of the round (`drafting_share`,
from the policy's costs). A looked-up proposal is taken where its accepted tokens per round,
at a round that much cheaper, reach the model's: (1 + L) >= (1 - share) (1 + M), with L and M
the decayed mean tokens each half had accepted per round. Lookup's guess is scored wherever it
finds one, taken or not (a verdict on the model's tokens tells how far the guess would have
gone), so a half the rule set aside is still measured. Free of torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from speculative.sequence import common_prefix_length

LOOKUP, MODEL = "lookup", "model"
DECAY = 0.9  # weight of the past in L and M: as the policy's estimates age
# M before a model round is measured, weighing one round: where lookup finds a continuation
# everywhere, one that brings less than this at its discount lets the model be tried.
MODEL_PRIOR_TOKENS = 1.0


@dataclass
class _Guess:
    """A half's tokens after `position`, not yet scored; `accepted`: how many committed already."""

    source: str
    position: int
    token_ids: list[int]
    accepted: int = 0


@dataclass
class CascadeChoice:
    drafting_share: float | None = None  # None (unpriced, or switched off): lookup wherever it finds a continuation
    _yields: dict[str, list[float]] = field(default_factory=lambda: {LOOKUP: [0.0, 0.0],
                                                                     MODEL: [MODEL_PRIOR_TOKENS, 1.0]})
    _pending: list[_Guess] = field(default_factory=list)

    def takes_lookup(self) -> bool:
        """Whether a continuation lookup found should be proposed (the model's tokens otherwise)."""
        (lookup_tokens, lookup_rounds), (model_tokens, model_rounds) = self._yields[LOOKUP], self._yields[MODEL]
        if self.drafting_share is None or not lookup_rounds:
            return True
        return 1.0 + lookup_tokens / lookup_rounds >= (1.0 - self.drafting_share) * (1.0 + model_tokens / model_rounds)

    def guessed(self, source: str, position: int, token_ids: Sequence[int]) -> None:
        """`source` would propose (or proposed) token_ids after `position` committed tokens."""
        if token_ids:
            self._pending.append(_Guess(source, position, list(token_ids)))

    def committed(self, base_len: int, token_ids: Sequence[int]) -> None:
        """A verdict committed token_ids after base_len: scores the guesses made there. One that
        agreed with all of them goes on to the next verdict's; one that a stretch passed by is dropped."""
        still = []
        for guess in self._pending:
            if guess.position != base_len:
                if guess.position > base_len:
                    still.append(guess)
                continue
            agreed = common_prefix_length(guess.token_ids, token_ids)
            guess.accepted += agreed
            if agreed == len(token_ids) < len(guess.token_ids):  # undecided: the rest waits for the next verdict
                still.append(_Guess(guess.source, base_len + agreed, guess.token_ids[agreed:], guess.accepted))
            else:
                totals = self._yields[guess.source]
                totals[0], totals[1] = DECAY * totals[0] + guess.accepted, DECAY * totals[1] + 1.0
        self._pending = still
