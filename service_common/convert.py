"""Proto messages <-> core types. Proto3 zero values mean "default" (see common.proto).

Imported by the orchestrator and the n-gram draft worker, which load no torch: what
needs torch (the draft's distributions) is imported by the functions that convert it,
which only the workers with a model call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from foundation.errors import InvalidArgument
from foundation.load import StepLoad
from specdec.v1 import common_pb2, target_pb2
from speculative.prompt_lookup import MAX_LOOKUP_NGRAM, LookupRounds, LookupStop
from speculative.stats import GenerationStats, RoundStats
from speculative.types import (
    FinishReason,
    NextTokenKind,
    SamplingParams,
    Verdict,
    VerifyResult,
    check_drafter_name,
)

if TYPE_CHECKING:
    from service_common.telemetry import WorkerLoad
    from speculative.sampling import SparseProbs

NEXT_TOKEN_KIND_TO_PROTO = {
    NextTokenKind.RECOVERED: common_pb2.NEXT_TOKEN_KIND_RECOVERED,
    NextTokenKind.BONUS: common_pb2.NEXT_TOKEN_KIND_BONUS,
}
NEXT_TOKEN_KIND_FROM_PROTO = {v: k for k, v in NEXT_TOKEN_KIND_TO_PROTO.items()}
FINISH_REASON_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP_TOKEN: common_pb2.FINISH_REASON_STOP_TOKEN,
}


def sampling_from_proto(
    message: common_pb2.SamplingParams, default_max_new_tokens: int
) -> SamplingParams:
    """Validated core params; raises InvalidArgument naming the bad field."""
    if message.max_new_tokens < 0:
        raise InvalidArgument(
            f"max_new_tokens must be >= 1 (0 = server default), got {message.max_new_tokens}"
        )
    return SamplingParams(
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=message.top_p if message.top_p != 0.0 else 1.0,
        seed=message.seed if message.HasField("seed") else None,
        max_new_tokens=message.max_new_tokens or default_max_new_tokens,
        stop_token_ids=tuple(message.stop_token_ids),
    ).validate()


def check_speculation_params(message: common_pb2.SpeculationParams) -> None:
    """The drafting settings a request may set, each in its range (0 = the draft worker's
    default): checked by the orchestrator and again by the draft worker, with one message
    each. The draft worker also checks the lookup sizes it fills in from its defaults."""
    check_drafter_name(message.drafter)
    if message.draft_top_k < 0:
        raise InvalidArgument(
            f"draft_top_k must be >= 0 (0 = server default), got {message.draft_top_k}"
        )
    for name in ("prompt_lookup_min", "prompt_lookup_max"):
        if not 0 <= getattr(message, name) <= MAX_LOOKUP_NGRAM:
            raise InvalidArgument(
                f"{name} must be in 1..{MAX_LOOKUP_NGRAM} (0 = server default), "
                f"got {getattr(message, name)}"
            )
    if message.prompt_lookup_min and message.prompt_lookup_max:
        LookupStop(message.prompt_lookup_min, message.prompt_lookup_max)  # raises for min > max


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        max_new_tokens=params.max_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
    )
    if params.seed is not None:
        message.seed = params.seed
    return message


def lookup_stop_from_proto(message: common_pb2.LookupStop) -> LookupStop:
    """InvalidArgument for sizes prompt lookup refuses."""
    return LookupStop(message.min_ngram, message.max_ngram)


def lookup_stop_to_proto(stop: LookupStop) -> common_pb2.LookupStop:
    return common_pb2.LookupStop(min_ngram=stop.min_ngram, max_ngram=stop.max_ngram)


def lookup_rounds_from_proto(message: target_pb2.LookupRounds) -> LookupRounds:
    """InvalidArgument for sizes prompt lookup refuses, or a k out of range."""
    return LookupRounds(
        lookup_stop_from_proto(message.sizes), message.max_draft_tokens, message.room
    )


def lookup_rounds_to_proto(lookup: LookupRounds) -> target_pb2.LookupRounds:
    return target_pb2.LookupRounds(
        sizes=lookup_stop_to_proto(lookup.sizes),
        max_draft_tokens=lookup.max_draft_tokens,
        room=lookup.room,
    )


def sparse_from_proto(message: common_pb2.SparseDistribution) -> SparseProbs:
    if len(message.token_ids) != len(message.probs) or not message.token_ids:
        raise InvalidArgument(
            f"a draft distribution needs as many probs as token ids (>= 1), got "
            f"{len(message.token_ids)} ids and {len(message.probs)} probs"
        )
    import torch

    from speculative.sampling import SparseProbs

    return SparseProbs(
        torch.tensor(list(message.token_ids), dtype=torch.long), torch.tensor(list(message.probs))
    )


def sparse_to_proto(probs: SparseProbs | None) -> common_pb2.SparseDistribution:
    """None (a tree's deterministic token): the empty distribution."""
    if probs is None:
        return common_pb2.SparseDistribution()
    return common_pb2.SparseDistribution(
        token_ids=probs.token_ids.tolist(), probs=probs.probs.tolist()
    )


def draft_probs_from_proto(draft) -> list[SparseProbs | None] | None:
    """A target_pb2.Draft's distributions; in a tree, an empty one is a deterministic token (None)."""
    if not draft.distributions:
        return None
    return [
        None if draft.parents and not d.token_ids and not d.probs else sparse_from_proto(d)
        for d in draft.distributions
    ]


def round_stats_to_proto(
    stats: RoundStats, proposal_bytes: int = 0, verdict_bytes: int = 0
) -> common_pb2.RoundStats:
    return common_pb2.RoundStats(
        round=stats.index,
        base_len=stats.base_len,
        num_drafted=stats.num_drafted,
        num_accepted=stats.num_accepted,
        next_token_kind=NEXT_TOKEN_KIND_TO_PROTO[stats.next_token_kind],
        draft_ns=stats.draft_ns,
        verify_rtt_ns=stats.verify_ns,
        target_compute_ns=stats.target_compute_ns,
        proposal_bytes=proposal_bytes,
        verdict_bytes=verdict_bytes,
        queue_ns=stats.step.queue_ns if stats.step else 0,
        batch_tokens=stats.step.batch_tokens if stats.step else 0,
        batch_sessions=stats.step.batch_sessions if stats.step else 0,
        stretch=stats.streamed,
    )


def round_stats_from_proto(message: common_pb2.RoundStats, num_committed: int) -> RoundStats:
    return RoundStats(
        index=message.round,
        base_len=message.base_len,
        num_drafted=message.num_drafted,
        num_accepted=message.num_accepted,
        num_committed=num_committed,
        next_token_kind=NEXT_TOKEN_KIND_FROM_PROTO.get(
            message.next_token_kind, NextTokenKind.BONUS
        ),
        draft_ns=message.draft_ns,
        verify_ns=message.verify_rtt_ns,
        target_compute_ns=message.target_compute_ns,
        step=StepLoad(message.queue_ns, 0, message.batch_tokens, message.batch_sessions, 0)
        if message.batch_sessions
        else None,
        streamed=message.stretch,
    )


def step_load_from_proto(message: common_pb2.StepLoad) -> StepLoad | None:
    """None for a step the target did not report (an older target, a discarded proposal)."""
    if not message.batch_sessions and not message.queue_ns:
        return None
    return StepLoad(
        message.queue_ns,
        message.step_ns,
        message.batch_tokens,
        message.batch_sessions,
        message.waiting_sessions,
        message.cost_base_ns,
        message.cost_per_token_ns,
    )


def step_load_to_proto(load: StepLoad | None, admission_wait_ns: int = 0) -> common_pb2.StepLoad:
    """The step a call's work ran in; the call's wait for admission counts as queueing."""
    if load is None:
        return common_pb2.StepLoad(queue_ns=admission_wait_ns)
    return common_pb2.StepLoad(
        queue_ns=load.queue_ns + admission_wait_ns,
        step_ns=load.step_ns,
        batch_tokens=load.batch_tokens,
        batch_sessions=load.batch_sessions,
        waiting_sessions=load.waiting_sessions,
        cost_base_ns=load.cost_base_ns,
        cost_per_token_ns=load.cost_per_token_ns,
    )


def decision_to_proto(
    result: VerifyResult, context_length: int, step: common_pb2.StepLoad
) -> target_pb2.Decision:
    if result.stopped:
        finish_reason = common_pb2.FINISH_REASON_STOP_TOKEN
    elif result.committed_len >= context_length:  # not even a k = 0 proposal fits
        finish_reason = common_pb2.FINISH_REASON_LENGTH
    else:
        finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
    return target_pb2.Decision(
        num_accepted=result.verdict.num_accepted,
        next_token_id=result.verdict.next_token_id,
        next_token_kind=NEXT_TOKEN_KIND_TO_PROTO[result.verdict.next_token_kind],
        committed_len=result.committed_len,
        target_compute_ns=result.target_compute_ns,
        finish_reason=finish_reason,
        step=step,
        path=list(result.path or ()),
    )


def decision_from_proto(
    decision: target_pb2.Decision,
    base_len: int,
    proposed: Sequence[int],
    received_ns: int,
    num_drafted: int | None = None,
    tree: bool = False,
) -> VerifyResult:
    """The decision on `proposed` at base_len (a draft, or the looked-up tokens a stretch's
    pass accepted, of num_drafted it verified; tree: `proposed` is a tree's accepted path),
    already checked to be consistent."""
    kind = NEXT_TOKEN_KIND_FROM_PROTO[decision.next_token_kind]
    verdict = Verdict(decision.num_accepted, decision.next_token_id, kind)
    return VerifyResult(
        verdict=verdict,
        token_ids=verdict.committed_tokens(list(proposed))[: decision.committed_len - base_len],
        committed_len=decision.committed_len,
        stopped=decision.finish_reason == common_pb2.FINISH_REASON_STOP_TOKEN,
        target_compute_ns=decision.target_compute_ns,
        step=step_load_from_proto(decision.step),
        received_ns=received_ns,
        num_drafted=len(proposed) if num_drafted is None else num_drafted,
        path=tuple(decision.path) if tree else None,
        target_handled_ns=decision.target_handled_ns,
    )


def worker_load_to_proto(load: WorkerLoad) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(
        active_sessions=load.active_sessions,
        max_sessions=load.max_sessions,
        cached_tokens=load.cached_tokens,
        max_cached_tokens=load.max_cached_tokens,
        queued_calls=load.queued_calls,
        running_calls=load.running_calls,
        max_running=load.max_running,
        mean_batch_tokens=load.mean_batch_tokens,
        max_batch_tokens=load.max_batch_tokens,
    )


def generation_stats_to_proto(
    stats: GenerationStats, orchestrator_ns: int = 0, num_prefill_tokens: int = 0
) -> common_pb2.GenerationStats:
    return common_pb2.GenerationStats(
        num_generated_tokens=stats.num_generated_tokens,
        num_rounds=stats.num_rounds,
        num_drafted=stats.num_drafted,
        num_accepted=stats.num_accepted,
        acceptance_rate=stats.acceptance_rate,
        mean_accepted_per_round=stats.mean_accepted_per_round,
        accepted_per_position=stats.accepted_per_position,
        drafted_per_position=stats.drafted_per_position,
        prefill_ns=stats.prefill_ns,
        draft_ns=stats.draft_ns,
        verify_ns=stats.verify_ns,
        target_compute_ns=stats.target_compute_ns,
        network_ns=stats.network_ns,
        orchestrator_ns=orchestrator_ns,
        total_ns=stats.total_ns,
        num_prefill_tokens=num_prefill_tokens,
        num_streamed_tokens=stats.num_streamed,
        queue_ns=stats.queue_ns,
    )


def model_info(loaded, device: str, step_ms: Sequence[float] = ()) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_id=loaded.name,
        tokenizer_fingerprint=loaded.fingerprint,
        vocab_size=loaded.vocab_size,
        context_length=loaded.context_length,
        device=device,
        dtype=str(loaded.dtype).removeprefix("torch."),
        step_ms=list(step_ms),
        row_invariance=loaded.row_invariance.describe()
        if getattr(loaded, "row_invariance", None)
        else "off",
    )
