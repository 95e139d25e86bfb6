"""The speculation loop, and an in-process generator built on it.

`speculation_rounds` is the loop the draft service runs with a remote target; here the
target is a local `TargetSession`. Both sides are reached through small interfaces, so
the loop is the same code in process and across the network.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from speculative.drafters import EMPTY_PROPOSAL, Drafter, DraftSession, LookupStop, Proposal
from speculative.fingerprint import check_compatible
from speculative.loading import LoadedModel
from speculative.limits import validate_num_speculative_tokens
from speculative.policy import Action, AdaptiveK, FixedK, MeasuredCosts, SpeculationPolicy, Turn
from speculative.sampling import SamplingParams, SparseProbs
from speculative.stats import GenerationStats, RoundStats, per_token_ns
from speculative.target import TargetSession, VerifyResult


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens or the context length reached
    STOP_TOKEN = "stop_token"  # a stop token id was generated (it is included)


class Verifier(Protocol):
    """The target as the loop sees it: a local TargetSession or a remote stream."""

    def verify(
        self, base_len: int, draft_token_ids: Sequence[int], draft_probs: Sequence[SparseProbs] | None
    ) -> VerifyResult: ...

    def decode(self, base_len: int, max_tokens: int, until: LookupStop | None = None) -> Iterator[VerifyResult]:
        """A stretch: target-only decoding of up to max_tokens tokens, one result per
        token, ending after a stop token or the first token at which prompt lookup with
        `until`'s sizes finds text to copy."""
        ...


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
) -> Iterator[RoundResult]:
    """Runs rounds until a stop token, max_new_tokens or the context length.

    Each step is either a round (draft k tokens, verify them in one target pass) or, when
    the policy finds that faster, a stretch of tokens the target decodes alone, each
    yielded as it comes. On entry verifier and draft both hold `base_len` committed
    tokens; after each yielded result both hold the new committed length.
    """
    num_generated = index = 0
    draft_read_prompt = draft is None
    while True:
        start = time.perf_counter_ns()
        # Never draft or decode past max_new_tokens or the context.
        room = min(params.max_new_tokens - num_generated, context_length - base_len)
        action = policy.next_action(room) if draft is not None else Action()
        solo = min(action.stretch, room)
        until = None  # where the stretch ends early: none for a stretch that speculation lost to
        if not solo and not draft_read_prompt:
            # The draft reads the prompt only now: a call the target decodes alone from
            # its start never runs the draft model on it.
            draft.prefill()
            draft_read_prompt, start = True, time.perf_counter_ns()
        if not solo:
            k = min(action.k, room - 1)
            proposal = draft.propose(k) if k > 0 else EMPTY_PROPOSAL
            draft_ns = time.perf_counter_ns() - start
            if k > 0:
                policy.observe_turn(proposed=bool(proposal.token_ids))
            if k > 0 and not proposal.token_ids:  # nothing to verify: a round trip for one token?
                # A lookup drafter's stretch ends where it would propose again.
                until = draft.lookup_stop()
                turn = Turn.NOTHING_UNTIL_MATCH if until is not None else Turn.NOTHING_PROPOSED
                solo = min(policy.next_action(room, turn).stretch, room)
        if solo:
            stretch_start, intervals = start, []
            steps = _solo_stretch(verifier, draft, base_len, solo, until)
        else:
            steps = (_round(verifier, draft, base_len, proposal, draft_ns),)
        for stats, result in steps:
            if solo:
                intervals.append(stats.verify_ns)
            stats = dataclasses.replace(stats, index=index)  # a stretch's tokens share its index
            index += not solo
            base_len, num_generated = base_len + len(result.token_ids), num_generated + len(result.token_ids)
            finish_reason = _finish_reason(result, num_generated >= params.max_new_tokens or base_len >= context_length)
            yield RoundResult(result.token_ids, stats, finish_reason)
            # Measured after the caller is done with the result: what a round (or a
            # streamed token) costs includes passing it on.
            policy.observe(stats, time.perf_counter_ns() - start)
            start = time.perf_counter_ns()
            if finish_reason is not None:
                return
        index += bool(solo)
        if solo and intervals:
            # The draft catches up on the stretch now, not within the next proposal: it
            # is what starting a stretch costs, not what drafting does.
            draft.prefill()
            draft_read_prompt = True
            policy.observe_stretch(len(intervals), time.perf_counter_ns() - stretch_start, per_token_ns(intervals),
                                   empty_turns=len(intervals) - 1 if until else 0)


def _round(verifier: Verifier, draft: DraftSession | None, base_len: int, proposal: Proposal,
           draft_ns: int) -> tuple[RoundStats, VerifyResult]:
    """Verifies a proposal in one round trip and brings the draft to the verdict."""
    start = time.perf_counter_ns()
    # One round trip to the target, which commits and cuts at stop tokens.
    result = verifier.verify(base_len, proposal.token_ids, proposal.draft_probs)
    verify_ns = time.perf_counter_ns() - start
    _apply_to_draft(draft, base_len, result)
    stats = RoundStats(
        0, base_len, len(proposal), result.verdict.num_accepted, len(result.token_ids),
        result.verdict.next_token_kind, draft_ns, verify_ns, result.target_compute_ns, step=result.step,
    )
    return stats, result


def _solo_stretch(verifier: Verifier, draft: DraftSession, base_len: int, num_tokens: int,
                 until: LookupStop | None):
    """(stats, result) per token the target decodes alone; the draft follows each."""
    tokens = verifier.decode(base_len, num_tokens, until)
    try:
        last = time.perf_counter_ns()
        for result in tokens:
            now = time.perf_counter_ns()
            draft.append(result.token_ids)
            stats = RoundStats(0, base_len, 0, 0, len(result.token_ids), result.verdict.next_token_kind,
                               0, now - last, result.target_compute_ns, streamed=True, step=result.step)
            base_len, last = base_len + len(result.token_ids), now
            yield stats, result
    finally:
        tokens.close()  # stops the target's stream when the caller stops early


def _finish_reason(result: VerifyResult, out_of_room: bool) -> FinishReason | None:
    if result.stopped:
        return FinishReason.STOP_TOKEN
    return FinishReason.LENGTH if out_of_room else None


def _apply_to_draft(draft: DraftSession | None, base_len: int, result: VerifyResult) -> None:
    """Rolls the draft back to its accepted prefix and appends the target's tokens."""
    if draft is None:
        return
    num_kept_drafts = min(result.verdict.num_accepted, len(result.token_ids))
    draft.truncate_to(base_len + num_kept_drafts)
    draft.append(result.token_ids[num_kept_drafts:])


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]  # generated tokens, a stop token included
    finish_reason: FinishReason
    stats: GenerationStats


class SpeculativeGenerator:
    """Target + drafter in one process: the reference for the services' behaviour."""

    def __init__(self, target: LoadedModel, drafter: Drafter | None = None):
        if drafter is not None:
            check_compatible(target.name, target.fingerprint, drafter.name, drafter.fingerprint)
        self.target = target
        self.drafter = drafter
        # What adaptive calls measured of the costs: it seeds the next call's policy (as
        # the draft service does per target), so a call can decide before measuring.
        self.measured_costs: MeasuredCosts | None = None

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        k: int | SpeculationPolicy = 4,
    ) -> GenerationResult:
        """Generates with speculation (k = 0 or no drafter: target-only decoding)."""
        start = time.perf_counter_ns()
        params.validate()
        policy = k if isinstance(k, SpeculationPolicy) else FixedK(validate_num_speculative_tokens(k))
        adaptive = isinstance(policy, AdaptiveK)
        if adaptive and not policy.measured and self.measured_costs is not None:
            policy.seed(self.measured_costs)
        target = TargetSession(self.target, prompt_token_ids, params)
        draft = self._open_draft(prompt_token_ids, params, policy)
        stats = GenerationStats(prefill_ns=time.perf_counter_ns() - start)
        token_ids: list[int] = []
        try:
            for result in speculation_rounds(
                target, draft, len(prompt_token_ids), params, policy, self.target.context_length
            ):
                token_ids += result.token_ids
                stats.record_round(result.stats)
                finish_reason = result.finish_reason
        finally:
            target.release()
            if draft is not None:
                draft.release()
            if adaptive and policy.measured:
                self.measured_costs = policy.costs()
        stats.total_ns = time.perf_counter_ns() - start
        return GenerationResult(token_ids, finish_reason, stats)

    def _open_draft(self, prompt_token_ids, params, policy) -> DraftSession | None:
        if self.drafter is None or policy.max_k == 0:
            return None
        return self.drafter.open(prompt_token_ids, params)
