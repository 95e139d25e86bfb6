"""The round loop: propose k tokens (k from the policy), verify them in one target pass, apply the verdict, commit,
repeat until a stop token or max_new_tokens; the same code in process and across the network (a `DraftSession` and
a `Verifier`, local or remote). Around it, each switched by `Features`: drafting ahead (drafting_ahead.py) and
stretches (stretches.py). Free of torch on purpose: the n-gram draft worker runs it without a model runtime.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass

from foundation.errors import InvalidArgument
from speculative.drafter_base import DraftSession
from speculative.drafting_ahead import AheadProposer
from speculative.policy import Action, SpeculationPolicy
from speculative.proposing import Proposer
from speculative.stats import RoundStats
from speculative.stretches import Stretches
from speculative.types import FinishReason, SamplingParams, VerifyResult
from speculative.verifier import Verifier


@dataclass(frozen=True)
class Features:
    """The optimisations around the round loop; with all off it is the textbook loop."""

    draft_ahead: bool = True  # where the verifier overlaps (drafting_ahead.py)
    stretches: bool = True  # target-only runs where speculation loses (stretches.py)
    target_lookup: bool = True  # in stretches, the target runs prompt lookup's rounds itself
    # A cascade's prompt lookup takes only the turns where it earns more than the draft
    # model at their measured costs (lookup_gate.py); off: wherever it finds a match.
    lookup_gate: bool = True
    # A model drafter stops where its next token would not pay (policy.stop_reach): 1.06x
    # across a link, as fast as without in process (benchmarks/results/link_qwen.md).
    draft_stop: bool = True

    @classmethod
    def disabled(cls, names: str) -> Features:
        """All on but the comma-separated `names` (DISABLE_NAMES: a draft worker's
        --disable); InvalidArgument naming the choices for an unknown one."""
        chosen = [name.strip() for name in names.split(",") if name.strip()]
        unknown = [name for name in chosen if name not in DISABLE_NAMES]
        if unknown:
            raise InvalidArgument(
                f"cannot disable {unknown}: choose among {', '.join(DISABLE_NAMES)}"
            )
        return cls(**{DISABLE_NAMES[name]: False for name in chosen})


# What a draft worker's --disable names: each optimisation, by the name users know it by.
DISABLE_NAMES = {
    "pipeline": "draft_ahead",
    "stretches": "stretches",
    "target_lookup": "target_lookup",
    "lookup_gate": "lookup_gate",
    "draft_stop": "draft_stop",
}


@dataclass(frozen=True)
class RoundResult:
    token_ids: list[int]  # tokens this round (or this token of a stretch) added to the output
    stats: RoundStats
    finish_reason: FinishReason | None  # set on the last round


def speculation_rounds(
    verifier: Verifier,
    draft: DraftSession | None,
    base_len: int,
    params: SamplingParams,
    policy: SpeculationPolicy,
    context_length: int,
    features: Features = Features(),
) -> Iterator[RoundResult]:
    """Rounds until a stop token, max_new_tokens or the context length. On entry verifier and draft hold `base_len`
    committed tokens; after each result, the new committed length (the draft also any proposal sent ahead)."""
    call = Call(base_len, params, context_length, policy)
    proposer = (AheadProposer if features.draft_ahead and verifier.overlaps else Proposer)(
        verifier, draft, params, features.lookup_gate
    )
    stretches = (
        Stretches(verifier, proposer, policy, features.target_lookup)
        if features.stretches and draft is not None
        else None
    )
    while not call.finished:
        call.start_ns = time.perf_counter_ns()
        action = (
            policy.next_action(call.room, stretches=stretches is not None)
            if draft is not None
            else Action()
        )
        if action.stretch and proposer.idle:
            yield from stretches.run(call, min(action.stretch, call.room), None, action.lookup_k)
            continue
        # 1. Propose (a proposal sent ahead may already be on its way).
        if proposer.idle and proposer.read_prompt():  # the draft's prefill is no round's cost
            call.start_ns = time.perf_counter_ns()
        k = min(action.k, call.room - 1)
        lookup_tokens = min(max(k, action.lookup_tokens), call.room - 1) if k > 0 else 0
        action = dataclasses.replace(action, lookup_tokens=lookup_tokens)
        if lookup_tokens * action.width >= call.context_room:  # a tree's every node fits
            action = dataclasses.replace(action, width=1)
        sent = proposer.propose(call.base_len, k, action, features.draft_stop)
        if k > 0 and not sent.ahead:
            policy.observe_turn(proposed=bool(sent.proposal.token_ids))
            if not sent.proposal.token_ids and stretches is not None:  # a round trip for one token?
                stretch = stretches.after_empty_turn(call.room)
                if stretch:  # a lookup drafter's stretch ends where it would propose again
                    yield from stretches.run(call, stretch, draft.lookup_stop())
                    continue
        # 2. Verify it in one target pass; 3. apply the verdict to the draft; 4. commit.
        proposer.send(sent, action, call.room)
        result, stats = proposer.receive(sent)
        proposer.apply_to_draft(sent, result)
        yield from call.commit(result, stats)


class Call:
    """What one call has committed, and what it may still generate."""

    def __init__(
        self, base_len: int, params: SamplingParams, context_length: int, policy: SpeculationPolicy
    ):
        self.base_len = base_len
        self.params = params
        self.context_length = context_length
        self.policy = policy
        self.num_generated = 0
        self.start_ns = 0  # when the current step began (its decision)
        self.finish_reason: FinishReason | None = None

    @property
    def room(self) -> int:
        """Tokens this call may still generate (never past max_new_tokens or the context)."""
        return min(
            self.params.max_new_tokens - self.num_generated, self.context_length - self.base_len
        )

    @property
    def context_room(self) -> int:
        """Positions left in the context: a tree's nodes hold some while it is verified."""
        return self.context_length - self.base_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def commit(self, result: VerifyResult, stats: RoundStats) -> Iterator[RoundResult]:
        self.base_len += len(result.token_ids)
        self.num_generated += len(result.token_ids)
        out_of_room = (
            self.num_generated >= self.params.max_new_tokens or self.base_len >= self.context_length
        )
        self.finish_reason = (
            FinishReason.STOP_TOKEN
            if result.stopped
            else FinishReason.LENGTH
            if out_of_room
            else None
        )
        yield RoundResult(result.token_ids, stats, self.finish_reason)
        # Measured after the caller is done with the result: a round's (a token's) cost includes passing it on.
        self.policy.observe_round(stats, time.perf_counter_ns() - self.start_ns)
        self.start_ns = time.perf_counter_ns()
