"""One Speculate call: the request checked and turned into core types, then the core's
speculation loop (speculative.generator.speculation_rounds) run against a remote target,
one SpeculateUpdate per round.

The loop is the core's, unchanged: this module only adapts its inputs (a policy, a
drafter set up for the call, a RemoteVerifier) and its outputs (updates with the wire
sizes of each round), and keeps the draft session consistent when a round fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from draft_service.config import DraftConfig
from draft_service.drafting import Drafters, DraftSettings, check_ngram_sizes
from draft_service.remote_verifier import RemoteVerifier, TargetInfo
from draft_service.sessions import SessionEntry
from service_common.convert import FINISH_REASON_TO_PROTO, round_stats_to_proto, sampling_from_proto
from specdec.v1 import draft_pb2
from speculative.errors import InvalidArgument, ResourceExhausted, StaleProposal
from speculative.fingerprint import check_compatible
from speculative.generator import RoundResult, speculation_rounds
from speculative.policy import AdaptiveK, FixedK, SpeculationPolicy
from speculative.sampling import validate_num_speculative_tokens


@dataclass
class SpeculatePlan:
    """A Speculate request, validated, in core types."""

    settings: DraftSettings  # sampling params and how to draft
    policy: SpeculationPolicy  # k per round (stateful: one per call)
    drafter: str  # requested drafter; "" = the session's own
    target_address: str  # "host:port" of the target worker
    target_session_id: str


def plan_call(request: draft_pb2.SpeculateRequest, config: DraftConfig) -> SpeculatePlan:
    """Raises InvalidArgument naming the bad field."""
    if not request.target.worker_address or not request.target.session_id:
        raise InvalidArgument("target.worker_address and target.session_id are required: the target session to verify with")
    params = sampling_from_proto(request.sampling, config.default_max_new_tokens)
    speculation = request.speculation
    k = speculation.num_speculative_tokens if speculation.HasField("num_speculative_tokens") else config.default_k
    validate_num_speculative_tokens(k)
    if speculation.draft_top_k < 0:
        raise InvalidArgument(f"draft_top_k must be >= 0 (0 = server default), got {speculation.draft_top_k}")
    min_ngram = speculation.prompt_lookup_min or config.prompt_lookup_min
    max_ngram = speculation.prompt_lookup_max or config.prompt_lookup_max
    check_ngram_sizes(min_ngram, max_ngram)
    return SpeculatePlan(
        settings=DraftSettings(params, speculation.draft_top_k or config.draft_top_k, min_ngram, max_ngram),
        policy=AdaptiveK(k) if speculation.adaptive else FixedK(k),
        drafter=speculation.drafter,
        target_address=request.target.worker_address,
        target_session_id=request.target.session_id,
    )


def check_start(
    entry: SessionEntry, request: draft_pb2.SpeculateRequest, plan: SpeculatePlan,
    drafters: Drafters, target: TargetInfo,
) -> int:
    """Checks that draft, target and request agree; returns the context length to
    generate within, in tokens."""
    if plan.drafter and drafters.resolve(plan.drafter) != entry.drafter:
        raise InvalidArgument(
            f"draft session {entry.session_id!r} was opened with drafter {entry.drafter!r}, not "
            f"{plan.drafter!r}: open a session with that drafter (or leave the drafter empty)"
        )
    if not request.base_len == entry.length == request.target.committed_len:
        raise StaleProposal(
            f"Speculate from length {request.base_len}, but draft session {entry.session_id!r} "
            f"holds {entry.length} committed tokens and the target handle says "
            f"{request.target.committed_len}: truncate both to the committed length first"
        )
    check_compatible(target.model_id, target.tokenizer_fingerprint,
                     drafters.model_name(entry.drafter), drafters.fingerprint(entry.drafter))
    limits = [n for n in (target.context_length, drafters.context_length(entry.drafter)) if n]
    context_length = min(limits) if limits else 2**31 - 1
    if request.base_len >= context_length:
        raise ResourceExhausted(
            f"session holds {request.base_len} tokens: the context length of {context_length} tokens is full"
        )
    return context_length


def run_rounds(
    entry: SessionEntry,
    verifier: RemoteVerifier,
    plan: SpeculatePlan,
    base_len: int,
    context_length: int,
    cancelled: Callable[[], bool],
) -> Iterator[draft_pb2.SpeculateUpdate]:
    """Runs rounds until finished or cancelled (checked after each round), yielding one
    update per round. If a round fails, the draft session goes back to the last committed
    length, so it is never left holding unverified drafts."""
    committed_len = base_len
    first_round = verifier.round
    try:
        for result in speculation_rounds(
            verifier, entry.draft, base_len, plan.settings.params, plan.policy, context_length
        ):
            committed_len += len(result.token_ids)
            yield _update(result, committed_len, first_round, verifier)
            if cancelled():
                return
    except BaseException:
        entry.draft.truncate_to(committed_len)
        raise


def _update(result: RoundResult, committed_len: int, first_round: int, verifier: RemoteVerifier) -> draft_pb2.SpeculateUpdate:
    stats = dataclasses.replace(result.stats, index=first_round + result.stats.index)  # per session
    return draft_pb2.SpeculateUpdate(
        token_ids=result.token_ids,
        committed_len=committed_len,
        round=round_stats_to_proto(stats, verifier.proposal_bytes, verifier.verdict_bytes),
        finished=result.finish_reason is not None,
        finish_reason=FINISH_REASON_TO_PROTO[result.finish_reason],
    )
