"""A worker lost mid-call (killed, partitioned) or a session evicted: the lost worker is
replaced and the call goes on from the committed tokens, so the client sees no token
lost or repeated."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc
from opentelemetry import trace

from orchestrator.generation_stats import CallStats
from orchestrator.placement import Placer
from orchestrator.planning import Plan
from orchestrator.rounds import Generated, RoundStreams
from orchestrator.workers import Worker
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

FAILOVER_SPAN = (
    "specdec.failover"  # a lost worker replaced, the session re-synced (read by `python -m report`)
)
# A lost worker or an evicted session: go on from the committed tokens elsewhere, or re-prefilled.
FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
PROBE_TIMEOUT_S = 2.0  # a live worker answers Info at once


def answers(worker: Worker) -> bool:
    try:
        worker.stub.Info(common_pb2.InfoRequest(), timeout=PROBE_TIMEOUT_S)
        return True
    except grpc.RpcError:
        return False


class Failover:
    """Syncing and rounds that go on, on other workers, when one is lost (at most
    max_failovers times a call, and only while its client is there)."""

    def __init__(
        self,
        max_failovers: int,
        context: grpc.ServicerContext,
        placer: Placer,
        streams: RoundStreams,
        generated: Generated,
        stats: CallStats,
    ):
        self.max_failovers, self.context = max_failovers, context
        self.placer, self.placement, self.streams = placer, placer.placement, streams
        self.generated, self.stats = generated, stats

    def sync(self, plan: Plan, keep: int, resumes: bool = False) -> None:
        """Brings target and draft to exactly the committed tokens, of which they share keep;
        resumes: the call's stream is under way (after a failover)."""
        tokens = self.generated.committed(plan)
        synced: set[tuple[str, str]] = set()  # (pool, address): done, not redone on a retry
        while True:
            try:
                self.placer.sync(plan, tokens, keep, synced, resumes)
                break
            except grpc.RpcError as error:
                self._replace_lost_workers(plan, error)
        self.placement.synced_len = len(tokens)

    def rounds(self, plan: Plan) -> Iterator[tuple[list[int], int]]:
        """The rounds of the placed workers' stream; when a worker is lost, the remaining
        ones from the workers put in its place."""
        while True:
            try:
                for token_ids, finish in self.streams.rounds(plan):
                    yield token_ids, finish
                    if finish:
                        return
                return
            except grpc.RpcError as error:
                self._replace_lost_workers(plan, error)
                self.sync(plan, self.placement.synced_len, resumes=True)

    def _replace_lost_workers(self, plan: Plan, error: grpc.RpcError) -> None:
        """Finds which worker is gone and replaces it. Raises the error when it is not a
        lost worker, failovers ran out, or the client left."""
        if (
            error.code() not in FAILOVER_CODES
            or self.stats.num_failovers >= self.max_failovers
            or not self.context.is_active()
        ):
            raise error
        self.stats.num_failovers += 1
        placement = self.placement
        with tracer.start_as_current_span(FAILOVER_SPAN) as span:
            lost = [
                w for w in (placement.target, placement.draft) if w is not None and not answers(w)
            ]
            log.warning(
                "failover %d of session %s after %s (%s): lost %s",
                self.stats.num_failovers,
                plan.record.session_id,
                error.code().name,
                error.details(),
                [w.address for w in lost] or "none, re-syncing",
            )
            span.set_attributes(
                {
                    "specdec.error": error.code().name,
                    "specdec.committed_len": len(self.generated.committed(plan)),
                    "specdec.lost": [f"{w.pool}:{w.address}" for w in lost],
                }
            )
            self.placer.replace(lost, plan)
            span.set_attribute("specdec.target", placement.target.address)
            span.set_attribute("specdec.draft", placement.draft.address if placement.draft else "")
