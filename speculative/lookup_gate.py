"""The cascade's gate: prompt lookup takes a turn from the draft model only where its
measured yield per round beats the model's at their costs.

A cascade (`prompt_lookup.LookupThenModelDrafter`) proposes what lookup finds wherever
it finds something, and the model elsewhere. Lookup is free to run, but a round of its
tokens still costs a target pass and a round trip: where its matches are short and its
guesses wrong, the model's round earns more. So the adaptive policy measures, for each
n-gram size lookup matched at, what lookup's rounds bring: its own rounds, and on the
model's turns what it would have proposed, checked against the target's tokens (free,
and unbiased for greedy decoding; under sampling a looked-up token is proposed with
certainty, so its check is the verdict it would have had). A size whose rounds earn
fewer tokens a nanosecond than the model's, E[tokens](a, k) / round(k), is refused:
there the model drafts. Nothing measured yet: no size is refused (the cascade as before).

Which drafter proposes depends on what earlier rounds measured, never on the current
round's draws, so the output stays exactly the target's (greedy and sampled).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from speculative.stats import LookupCheck

if TYPE_CHECKING:
    from speculative.estimator import Estimates

# Each size starts as if one round had proposed PRIOR_DRAFTED tokens, all accepted:
# optimistic, so lookup keeps its turns until its own evidence says otherwise.
PRIOR_ROUNDS, PRIOR_DRAFTED = 1.0, 4.0


@dataclass(frozen=True)
class LookupYield:
    """What lookup's rounds at one n-gram size brought, on average."""

    size: int
    drafted: float  # tokens it proposed a round
    accepted: float  # of them, accepted a round

    @property
    def tokens(self) -> float:
        """Tokens a round commits: the accepted ones and the target's own."""
        return self.accepted + 1.0


class LookupYields:
    """Decayed counts of lookup's rounds by n-gram size (weight `decay` on the past)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.counts: dict[int, list[float]] = {}  # size -> [rounds, drafted, accepted]

    def observe(self, check: LookupCheck) -> None:
        prior = [PRIOR_ROUNDS, PRIOR_ROUNDS * PRIOR_DRAFTED, PRIOR_ROUNDS * PRIOR_DRAFTED]
        counts = self.counts.setdefault(check.size, prior)
        observed = (1.0, check.drafted, check.accepted)
        counts[:] = [self.decay * count + new for count, new in zip(counts, observed)]

    def yields(self) -> tuple[LookupYield, ...]:
        return tuple(
            LookupYield(size, drafted / rounds, accepted / rounds)
            for size, (rounds, drafted, accepted) in sorted(self.counts.items())
        )


class PendingGuess:
    """Lookup's guess followed across rounds until the target's tokens decide it: a model
    round may commit fewer tokens than the guess holds, and its check must not stop
    there (that would count lookup short wherever the model is). One guess at a time, as
    the rounds lookup would have run; a stretch or a rollback in between drops it."""

    def __init__(self):
        self.check: LookupCheck | None = None
        self.token_ids: tuple[int, ...] = ()
        self.position = 0  # where the next committed token is compared

    def start(self, check: LookupCheck, token_ids: tuple[int, ...], base_len: int) -> None:
        if self.check is None:
            self.check, self.token_ids, self.position = check, token_ids, base_len

    def follow(self, base_len: int, token_ids: list[int]) -> LookupCheck | None:
        """The check, once the tokens committed after base_len decide it (else None)."""
        check = self.check
        if check is None or base_len != self.position:
            self.check = None
            return None
        for token_id in token_ids:
            matched = check.accepted
            if matched == check.drafted or token_id != self.token_ids[matched]:
                self.check = None
                return check
            check = dataclasses.replace(check, accepted=matched + 1)
        self.check, self.position = check, base_len + len(token_ids)
        if check.accepted == check.drafted:
            self.check = None
            return check
        return None


def refused_sizes(e: Estimates, k: int) -> frozenset[int]:
    """The n-gram sizes at which lookup's rounds earn fewer tokens a nanosecond than the
    model's rounds of k (none before anything is measured)."""
    if not e.measured or k < 1:
        return frozenset()
    model_rate = e.tokens_per_ns(k)
    return frozenset(
        y.size
        for y in e.lookup_yields
        if y.tokens < model_rate * (e.compute_ns(round(y.drafted) + 1) + e.overhead_ns)
    )
