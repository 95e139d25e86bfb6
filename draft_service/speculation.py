"""One Speculate call (`SpeculateCall`): the request checked and turned into core types,
then the core's speculation loop (speculative.speculation_loop.speculation_rounds) run
against a remote target, one SpeculateUpdate per round (and per token of a stretch the
target decodes alone). The servicer only locks the session and hands the call its
deadline.

The loop is the core's, unchanged: this module only adapts its inputs (a policy, a
drafter set up for the call, a RemoteVerifier) and its outputs (updates with the wire
sizes of each round), and keeps the draft session consistent when a round fails.

Each round is also a `specdec.round` span (child of the Speculate server span; the
attributes are listed above `_observe_round`) and counted in the metric instruments
(service_common.telemetry); with telemetry off both are the API's no-ops. Its draft and
verify times also go into the worker's `DraftVerifyWindow` (the draft pool's HPA gauge).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from opentelemetry import trace

from draft_service.config import DraftConfig
from draft_service.drafting import Drafters, DraftSettings, apply_settings
from draft_service.remote_verifier import RemoteVerifier
from draft_service.round_times import DraftVerifyWindow
from draft_service.sessions import SessionEntry
from draft_service.target_connections import TargetConnections, TargetInfo
from foundation.errors import InvalidArgument, ResourceExhausted, StaleProposal
from foundation.limits import validate_num_speculative_tokens
from model_runtime.fingerprint import check_compatible
from service_common import telemetry
from service_common.convert import (
    FINISH_REASON_TO_PROTO,
    check_speculation_params,
    round_stats_to_proto,
    sampling_from_proto,
)
from service_common.deadlines import Deadline, bounded
from service_common.status import Unavailable
from specdec.v1 import draft_pb2
from speculative.estimator import MeasuredCosts
from speculative.policy import AdaptiveK, FixedK, SpeculationPolicy
from speculative.prompt_lookup import LookupStop
from speculative.speculation_loop import Features, RoundResult, speculation_rounds

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)


@dataclass
class SpeculatePlan:
    """A Speculate request, validated, in core types."""

    settings: DraftSettings  # sampling params and how to draft
    policy: SpeculationPolicy  # k per round (stateful: one per call)
    drafter: str  # requested drafter; "" = the session's own
    target_address: str  # "host:port" of the target worker
    target_session_id: str
    features: Features  # the optimisations around the round loop this worker runs


def plan_call(request: draft_pb2.SpeculateRequest, config: DraftConfig) -> SpeculatePlan:
    """Raises InvalidArgument naming the bad field."""
    if not request.target.worker_address or not request.target.session_id:
        raise InvalidArgument(
            "target.worker_address and target.session_id are required: the target session to verify with"
        )
    params = sampling_from_proto(request.sampling, config.default_max_new_tokens)
    speculation = request.speculation
    k = (
        speculation.num_speculative_tokens
        if speculation.HasField("num_speculative_tokens")
        else config.default_k
    )
    validate_num_speculative_tokens(k)
    check_speculation_params(speculation)
    min_ngram = speculation.prompt_lookup_min or config.prompt_lookup_min
    max_ngram = speculation.prompt_lookup_max or config.prompt_lookup_max
    LookupStop(min_ngram, max_ngram)  # raises InvalidArgument for sizes prompt lookup refuses
    features = config.features()
    return SpeculatePlan(
        settings=DraftSettings(
            params, speculation.draft_top_k or config.draft_top_k, min_ngram, max_ngram
        ),
        policy=(
            AdaptiveK(k, overlaps=features.draft_ahead, max_width=config.tree_width)
            if speculation.adaptive
            else FixedK(k, config.tree_width)
        ),
        drafter=speculation.drafter,
        target_address=request.target.worker_address,
        target_session_id=request.target.session_id,
        features=features,
    )


def check_start(
    entry: SessionEntry,
    request: draft_pb2.SpeculateRequest,
    plan: SpeculatePlan,
    drafters: Drafters,
    target: TargetInfo,
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
    check_compatible(
        target.model_id,
        target.tokenizer_fingerprint,
        drafters.model_name(entry.drafter),
        drafters.fingerprint(entry.drafter),
    )
    limits = [n for n in (target.context_length, drafters.context_length(entry.drafter)) if n]
    context_length = min(limits) if limits else 2**31 - 1
    if request.base_len >= context_length:
        raise ResourceExhausted(
            f"session holds {request.base_len} tokens: the context length of {context_length} tokens is full"
        )
    return context_length


class SpeculateCall:
    """A Speculate request, checked before its session is locked, then run on it: the
    target asked about its model, the call's policy chosen and started, the rounds run
    over a RemoteVerifier, what the policy measured handed on to the next call; the
    rounds' times added to the worker's `round_times`."""

    def __init__(
        self,
        request: draft_pb2.SpeculateRequest,
        config: DraftConfig,
        drafters: Drafters,
        targets: TargetConnections,
        round_times: DraftVerifyWindow,
    ):
        self.request, self.config = request, config
        self.drafters, self.targets = drafters, targets
        self.round_times = round_times
        self.plan = plan_call(request, config)  # raises InvalidArgument naming the bad field

    def run(
        self, entry: SessionEntry, deadline: Deadline, cancelled: Callable[[], bool]
    ) -> Iterator[draft_pb2.SpeculateUpdate]:
        """The rounds on the locked session `entry`, as long as the caller waits for them
        (`deadline`; no cap on the whole call: under load a long generation is slow, not
        hung); `cancelled` is asked after each round."""
        plan, config = self.plan, self.config
        # One answer from the target: within the stall timeout and the caller's deadline.
        target = self.targets.info(
            plan.target_address, bounded(deadline.remaining(), config.verdict_stall_timeout_s)
        )
        context_length = check_start(entry, self.request, plan, self.drafters, target)
        apply_settings(entry.draft, plan.settings)
        earlier = self._choose_policy(entry)
        plan.policy.start_call(target.step_ms, earlier)  # priced by the target's own timing
        verifier = RemoteVerifier(
            self.targets.stub(plan.target_address),
            plan.target_address,
            plan.target_session_id,
            plan.settings.params,
            entry.next_round,
            deadline,
            config.verdict_stall_timeout_s,
            overlaps=plan.features.draft_ahead,
        )
        try:
            yield from run_rounds(
                entry,
                verifier,
                plan,
                self.request.base_len,
                context_length,
                cancelled,
                self.round_times,
            )
        except Unavailable:  # it may come back with another model: ask it again
            self.targets.forget(plan.target_address)
            raise
        finally:
            self._end(entry, verifier)

    def _choose_policy(self, entry: SessionEntry) -> MeasuredCosts | None:
        """An adaptive call goes on with its session's policy where that has the same k
        (the next turn keeps what it measured); else its new policy is seeded with what
        earlier calls measured between this drafter and this target (returned)."""
        if not isinstance(self.plan.policy, AdaptiveK):
            return None
        earlier = None
        if entry.policy is not None and entry.policy.max_k == self.plan.policy.max_k:
            self.plan.policy = entry.policy
        else:
            earlier = self.targets.costs(self.plan.target_address, entry.drafter)
        entry.policy = self.plan.policy
        return earlier

    def _end(self, entry: SessionEntry, verifier: RemoteVerifier) -> None:
        plan = self.plan
        log.debug(
            "speculate ended",
            extra={
                "fields": {
                    "session_id": entry.session_id,
                    "target": plan.target_address,
                    "rounds": verifier.round - entry.next_round,
                    "committed_len": entry.length,
                }
            },
        )
        entry.next_round = verifier.round
        verifier.close()
        if costs := plan.policy.end_call():
            self.targets.remember_costs(plan.target_address, entry.drafter, costs)


def run_rounds(
    entry: SessionEntry,
    verifier: RemoteVerifier,
    plan: SpeculatePlan,
    base_len: int,
    context_length: int,
    cancelled: Callable[[], bool],
    round_times: DraftVerifyWindow | None = None,
) -> Iterator[draft_pb2.SpeculateUpdate]:
    """Runs rounds until finished or cancelled (checked after each round), yielding one
    update per round, each added to `round_times` (the worker's; None: not kept). If a
    round fails, the draft session goes back to the last committed length, so it is never
    left holding unverified drafts."""
    committed_len = base_len
    first_round = verifier.round
    output = telemetry.OutputTiming()  # on the time_ns clock
    try:
        # Round times are taken around the loop's own work, not the sending of updates.
        round_start_ns = time.time_ns()
        rounds = speculation_rounds(
            verifier,
            entry.draft,
            base_len,
            plan.settings.params,
            plan.policy,
            context_length,
            plan.features,
        )
        with contextlib.closing(rounds):
            for result in rounds:
                round_end_ns = time.time_ns()
                committed_len += len(result.token_ids)
                update = _update(result, committed_len, first_round, verifier)
                _observe_round(update, result, entry.session_id, plan, round_start_ns, round_end_ns)
                if round_times is not None:
                    round_times.add(result.stats)
                output.add(len(result.token_ids), round_end_ns)
                yield update
                if cancelled():
                    return
                round_start_ns = time.time_ns()
    except BaseException:
        entry.draft.truncate_to(committed_len)
        raise
    finally:
        output.record()


def _update(
    result: RoundResult, committed_len: int, first_round: int, verifier: RemoteVerifier
) -> draft_pb2.SpeculateUpdate:
    stats = dataclasses.replace(result.stats, index=first_round + result.stats.index)  # per session
    return draft_pb2.SpeculateUpdate(
        token_ids=result.token_ids,
        committed_len=committed_len,
        round=round_stats_to_proto(stats, verifier.proposal_bytes, verifier.verdict_bytes),
        finished=result.finish_reason is not None,
        finish_reason=FINISH_REASON_TO_PROTO[result.finish_reason],
    )


# --- telemetry --------------------------------------------------------------------------

# specdec.round attributes (times in nanoseconds, sizes in bytes):
#   specdec.session_id: the draft session
#   specdec.round: round index within the session (Proposal.round)
#   specdec.base_len: committed length the proposal extended, in tokens
#   specdec.k: draft tokens proposed this round
#   specdec.max_k: the call's k (fixed), or the largest k of an adaptive call
#   specdec.adaptive: whether k is chosen per round (speculative.policy.AdaptiveK)
#   specdec.accepted: draft tokens accepted
#   specdec.committed: tokens the round added to the output (accepted + 1, less a stop cut)
#   specdec.next_token_kind: recovered or bonus
#   specdec.draft_ns: drafting the k tokens
#   specdec.verify_ns: round trip draft -> target -> draft
#   specdec.target_compute_ns: the target's forward pass and decision, as it reports
#   specdec.target_handled_ns: the target's whole time on the proposal, as it reports (0: not reported)
#   specdec.target_host_ns: of it, the time outside its pass and its step's queue: parsing,
#     session lock, bookkeeping, the verdict message
#   specdec.network_ns: verify_ns - target_compute_ns, the round trip less the target's pass
#     (speculative.stats.network_ns, docs/glossary.md)
#   specdec.transport_ns: verify_ns - target_handled_ns, the transport and serialization alone
#     (where the target reports its whole time; else the network time)
#   specdec.proposal_bytes: serialized Proposal
#   specdec.verdict_bytes: serialized Verdict
#   specdec.finish_reason: on the last round of a call: length or stop_token


def _observe_round(
    update: draft_pb2.SpeculateUpdate,
    result: RoundResult,
    session_id: str,
    plan: SpeculatePlan,
    start_ns: int,
    end_ns: int,
) -> None:
    """One finished round as a span (start and end in Unix nanoseconds) and in metrics;
    a token of a stretch only in metrics (the target's specdec.decode span times it)."""
    stats = result.stats
    telemetry.instruments().record_round(stats)
    if stats.streamed:
        return
    span = tracer.start_span(telemetry.ROUND_SPAN, start_time=start_ns)
    if span.is_recording():
        wire = update.round
        attributes = {
            "specdec.session_id": session_id,
            "specdec.round": wire.round,
            "specdec.base_len": stats.base_len,
            "specdec.k": stats.num_drafted,
            "specdec.max_k": plan.policy.max_k,
            "specdec.adaptive": isinstance(plan.policy, AdaptiveK),
            "specdec.accepted": stats.num_accepted,
            "specdec.committed": stats.num_committed,
            "specdec.next_token_kind": stats.next_token_kind.value,
            "specdec.draft_ns": stats.draft_ns,
            "specdec.verify_ns": stats.verify_ns,
            "specdec.target_compute_ns": stats.target_compute_ns,
            "specdec.network_ns": stats.network_ns,
            "specdec.transport_ns": stats.transport_ns,
            "specdec.target_handled_ns": stats.target_handled_ns,
            "specdec.target_host_ns": stats.target_host_ns,
            "specdec.proposal_bytes": wire.proposal_bytes,
            "specdec.verdict_bytes": wire.verdict_bytes,
        }
        if result.finish_reason is not None:
            attributes["specdec.finish_reason"] = result.finish_reason.value
        span.set_attributes(attributes)
    span.end(end_time=end_ns)
