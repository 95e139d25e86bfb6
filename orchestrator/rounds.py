"""The rounds of a call from its workers as placed: one Speculate stream on the draft,
or, without a draft, one Decode stream on the target; each round's tokens, how each was
produced, and its statistics."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from orchestrator.generation_stats import CallStats
from orchestrator.placement import Placement
from orchestrator.planning import Plan
from service_common.convert import (
    FINISH_REASON_TO_PROTO,
    round_stats_from_proto,
    sampling_to_proto,
    step_load_from_proto,
)
from service_common.deadlines import Deadline
from specdec.v1 import common_pb2, draft_pb2, orchestrator_pb2, target_pb2
from speculative.stats import RoundStats
from speculative.types import FinishReason, NextTokenKind, SamplingParams

SEED_STRIDE = 0x9E3779B97F4A7C15  # odd, so seeds moved on by different counts differ


def token_sources(round_stats: common_pb2.RoundStats) -> list[int]:
    """How each token a round committed was produced: its accepted draft tokens, then the
    target's recovered or bonus token; a round that drafted nothing (a token of a
    stretch, or a drafter with no proposal) is the target's alone. A stretch's pass
    that verified prompt lookup's tokens is a round."""
    if round_stats.num_drafted == 0:
        return [orchestrator_pb2.TOKEN_SOURCE_TARGET]
    last = (
        orchestrator_pb2.TOKEN_SOURCE_RECOVERED
        if round_stats.next_token_kind == common_pb2.NEXT_TOKEN_KIND_RECOVERED
        else orchestrator_pb2.TOKEN_SOURCE_BONUS
    )
    return [orchestrator_pb2.TOKEN_SOURCE_ACCEPTED] * round_stats.num_accepted + [last]


@dataclass
class Round:
    """One round's tokens (or one token the target decoded alone), as a worker sent them."""

    token_ids: list[int]
    finish_reason: int  # 0 while generation goes on
    stats: RoundStats
    sources: list[int]  # TokenSource of each token
    drafted: list[int]  # per token: the draft tokens of the round it ends, else 0


@dataclass
class Generated:
    """The tokens the workers committed in this call, with how each was produced."""

    token_ids: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)  # aligned with token_ids
    drafted: list[int] = field(default_factory=list)  # aligned with token_ids

    def add(self, round_: Round) -> None:
        self.token_ids.extend(round_.token_ids)
        self.sources += round_.sources
        self.drafted += round_.drafted

    def committed(self, plan: Plan) -> list[int]:
        """The session's tokens as they stand: the call's sequence, then what it generated."""
        return plan.tokens + self.token_ids


def remaining_params(params: SamplingParams, num_generated: int) -> SamplingParams:
    """The call's params for what is left after a failover: the remaining token budget,
    and a seed moved on by the tokens already drawn. Workers restart their generator
    from the seed they are sent; the request's own seed would reuse the first draws."""
    if not num_generated:
        return params
    remaining = params.replace(max_new_tokens=params.max_new_tokens - num_generated)
    if params.seed is None:
        return remaining
    return remaining.replace(seed=(params.seed + SEED_STRIDE * num_generated) % 2**63)


class RoundStreams:
    """Opens a call's stream of rounds on its workers as placed now, counts each round
    and adds its tokens to generated before passing it on."""

    def __init__(
        self,
        context: grpc.ServicerContext,
        deadline: Deadline,
        placement: Placement,
        generated: Generated,
        stats: CallStats,
    ):
        self.context, self.deadline, self.placement = context, deadline, placement
        self.generated, self.stats = generated, stats
        self.call = None  # the streaming call to a worker, cancelled with the client's

    def rounds(self, plan: Plan) -> Iterator[tuple[list[int], int]]:
        """(token_ids, finish_reason) per round (or per token the target decodes alone)."""
        stream = self._decode_alone(plan) if self.placement.draft is None else self._speculate(plan)
        for round_ in stream:
            self.stats.count_round(round_.stats)
            self.generated.add(round_)
            yield round_.token_ids, round_.finish_reason

    def cancel(self) -> None:
        """Stops the workers generating (a stop string was found)."""
        self.call.cancel()

    def _speculate(self, plan: Plan) -> Iterator[Round]:
        """The rounds of one Speculate stream. The target restarts its generator from the
        seed it is sent: moved on by the tokens drawn so far after a failover."""
        record, base_len = plan.record, len(plan.tokens) + len(self.generated.token_ids)
        speculation = common_pb2.SpeculationParams()
        speculation.CopyFrom(
            plan.speculation
        )  # the lookup sizes and draft_top_k travel as the client gave them
        speculation.num_speculative_tokens = plan.k
        self.call = self.placement.draft.stub.Speculate(
            draft_pb2.SpeculateRequest(
                session_id=record.draft.session_id,
                base_len=base_len,
                target=common_pb2.KvHandle(
                    worker_id=record.target.worker_id,
                    worker_address=self.placement.target.address,
                    session_id=record.target.session_id,
                    committed_len=base_len,
                ),
                sampling=sampling_to_proto(
                    remaining_params(plan.params, len(self.generated.token_ids))
                ),
                speculation=speculation,
            ),
            timeout=self.deadline.remaining(),
        )
        self.context.add_callback(self.call.cancel)
        for update in self.call:
            record.draft.committed_len = update.committed_len  # the draft holds each round's tokens
            yield _speculated_round(update)

    def _decode_alone(self, plan: Plan) -> Iterator[Round]:
        """Target-only decoding: one Decode stream up to max_new_tokens, with the call's sampling."""
        request = target_pb2.DecodeRequest(
            session_id=plan.record.target.session_id,
            base_len=len(plan.tokens) + len(self.generated.token_ids),
            sampling=sampling_to_proto(
                remaining_params(plan.params, len(self.generated.token_ids))
            ),
        )
        self.call = self.placement.target.stub.Decode(request, timeout=self.deadline.remaining())
        self.context.add_callback(self.call.cancel)
        for token in self.call:
            stats = _decoded_round_stats(token, index=self.stats.num_rounds)
            finish = _finish_of_decode(
                plan.params, len(self.generated.token_ids) + 1, token.token_id
            )
            yield Round(
                [token.token_id], finish, stats, [orchestrator_pb2.TOKEN_SOURCE_TARGET], [0]
            )


def _speculated_round(update: draft_pb2.SpeculateUpdate) -> Round:
    sources = token_sources(update.round)[: len(update.token_ids)]
    stats = round_stats_from_proto(update.round, len(update.token_ids))
    return Round(
        list(update.token_ids),
        update.finish_reason,
        stats,
        sources,
        [0] * (len(sources) - 1) + [update.round.num_drafted],
    )


def _decoded_round_stats(token: target_pb2.DecodeToken, index: int) -> RoundStats:
    """A token the target decoded alone, counted as a round that drafted nothing."""
    return RoundStats(
        index=index,
        base_len=token.committed_len - 1,
        num_drafted=0,
        num_accepted=0,
        num_committed=1,
        next_token_kind=NextTokenKind.BONUS,
        draft_ns=0,
        verify_ns=token.compute_ns,
        target_compute_ns=token.compute_ns,
        step=step_load_from_proto(token.step),
    )


def _finish_of_decode(params: SamplingParams, count: int, token: int) -> int:
    if token in params.stop_token_ids:
        return FINISH_REASON_TO_PROTO[FinishReason.STOP_TOKEN]
    return FINISH_REASON_TO_PROTO[FinishReason.LENGTH] if count == params.max_new_tokens else 0
