"""Where a call runs: a target (and a draft) worker whose session holds exactly the
committed tokens, kept where its KV caches are (affinity) while those workers live."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from foundation.errors import InvalidArgument
from orchestrator.config import OrchestratorConfig
from orchestrator.generation_stats import CallStats
from orchestrator.planning import Plan
from orchestrator.store import SessionRecord, WorkerHandle
from orchestrator.workers import DRAFT, TARGET, Worker, WorkerPool, close_worker_sessions
from service_common.convert import sampling_to_proto
from service_common.deadlines import Deadline
from service_common.telemetry import instruments
from specdec.v1 import common_pb2, draft_pb2, target_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

ROLLBACK_SPAN = "specdec.rollback"  # both workers truncated to the committed tokens (read by `python -m report`)


@dataclass
class Placement:
    """The workers serving the call, as placed (a draft of None: the target decodes alone)."""

    target: Worker | None = None
    draft: Worker | None = None
    synced_len: int = 0  # tokens both workers certainly hold (base of the last stream)


def check_room(plan: Plan, target: Worker) -> None:
    """The prompt and max_new_tokens fit the target's context, the tokens its vocabulary."""
    context_length = target.model.context_length
    room = context_length - len(plan.tokens)
    if room <= 0:
        raise InvalidArgument(
            f"prompt of {len(plan.tokens)} tokens does not fit the model's context length of "
            f"{context_length} tokens"
        )
    if plan.params.max_new_tokens > room:
        raise InvalidArgument(
            f"max_new_tokens {plan.params.max_new_tokens} is above the room left in the context: "
            f"{room} tokens ({len(plan.tokens)} of {context_length} used)"
        )
    for token in plan.tokens:
        if not 0 <= token < target.model.vocab_size:
            raise InvalidArgument(
                f"token id {token} is outside the vocabulary [0, {target.model.vocab_size})"
            )


class Placer:
    """Picks the call's workers and brings their sessions to the committed tokens.
    Truncate is bookkeeping (rpc_timeout_s); OpenSession and Extend prefill, under the
    call's deadline."""

    def __init__(
        self,
        config: OrchestratorConfig,
        pool: WorkerPool,
        deadline: Deadline,
        stats: CallStats,
        placement: Placement,
        in_flight: contextlib.ExitStack,
    ):
        self.rpc_timeout_s = config.rpc_timeout_s
        self.pool = pool
        self.deadline = deadline
        self.stats = stats
        self.placement = placement
        self.in_flight = in_flight  # counts the call on its workers' load until the call ends

    def place(self, plan: Plan) -> None:
        """The workers that hold the session's caches when they are alive, else the
        least-loaded ones; no draft when the call speculates nothing."""
        record, placement = plan.record, self.placement
        placement.target = self._worker_for(record.target, TARGET) or self._adopt(
            self.pool.pick_target()
        )
        check_room(plan, placement.target)
        if plan.k > 0:
            placement.draft = self._worker_for(record.draft, DRAFT) or self._adopt(
                self.pool.pick_draft(placement.target, plan.drafter)
            )
            if placement.draft is None:  # an empty draft pool: the target decodes alone
                instruments().fallbacks.add(1)

    def replace(self, lost: list[Worker], plan: Plan) -> None:
        """Puts other workers in place of lost ones: the target by another target
        (re-prefilled), the draft by another draft or, with none left, by none."""
        placement = self.placement
        for worker in lost:
            self.pool.suspect(worker)
            instruments().failovers.add(1, {"pool": worker.pool})
        if placement.target in lost:
            plan.record.target = None
            placement.target = self._adopt(self.pool.pick_target())
        if placement.draft in lost:
            plan.record.draft = None
            placement.draft = self._adopt(self.pool.pick_draft(placement.target, plan.drafter))
            if placement.draft is None:
                log.warning(
                    "no draft worker left: session %s goes on with target-only decoding",
                    plan.record.session_id,
                )
                instruments().fallbacks.add(1)

    def sync(
        self,
        plan: Plan,
        tokens: list[int],
        keep: int,
        synced: set[tuple[str, str]],
        resumes: bool = False,
    ) -> None:
        """Syncs each worker not yet in synced ((pool, address)) to tokens, adding it there;
        a worker's RpcError is raised, for the caller to replace it and retry. resumes: the
        call's stream is under way (a failover), its client waiting for the next token."""
        for worker, field in ((self.placement.target, "target"), (self.placement.draft, "draft")):
            if worker is None or (worker.pool, worker.address) in synced:
                continue
            setattr(
                plan.record,
                field,
                self.sync_worker(worker, getattr(plan.record, field), tokens, keep, plan, resumes),
            )
            synced.add((worker.pool, worker.address))

    def sync_worker(
        self,
        worker: Worker,
        handle: WorkerHandle | None,
        tokens: list[int],
        keep: int,
        plan: Plan,
        resumes: bool = False,
    ) -> WorkerHandle:
        """Rolls the worker's session back to what it shares with tokens, then extends
        it; opens (prefills) a new one where it has none, lost it, or shares nothing."""
        resumes = resumes and worker.pool == TARGET  # a target runs it beside its running sessions
        if handle is None or handle.address != worker.address:
            return self._open(worker, tokens, plan, resumes)
        keep = min(keep, handle.committed_len)
        # A draft session keeps the drafter it was opened with; a session keeps at least one token.
        if (worker.pool == DRAFT and handle.drafter != plan.drafter) or keep < 1:
            close_worker_sessions(self.pool, ((worker.pool, handle),), self.rpc_timeout_s)
            return self._open(worker, tokens, plan, resumes)
        try:
            return self._extend(worker, handle, tokens, keep, resumes)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                raise
            log.info("session %s evicted from %s: re-prefilling", handle.session_id, worker.address)
        return self._open(worker, tokens, plan, resumes)

    def roll_back(self, record: SessionRecord, cut_tokens: int) -> None:
        """Truncates both workers to the record's committed tokens; a draft left behind
        (its stream failed over to the target alone) keeps what it holds: the next call
        extends it."""
        length = len(record.token_ids)
        with tracer.start_as_current_span(ROLLBACK_SPAN) as span:
            span.set_attributes({"specdec.committed_len": length, "specdec.cut_tokens": cut_tokens})
            target, draft = self.placement.target, self.placement.draft
            if target is not None and record.target is not None:
                self._truncate(target, record.target, length)
            if draft is not None and record.draft is not None:
                self._truncate(draft, record.draft, min(length, record.draft.committed_len))

    def _worker_for(self, handle: WorkerHandle | None, pool: str) -> Worker | None:
        """The worker that already holds the session's cache, if it is still there."""
        worker = self.pool.by_address(pool, handle.address) if handle else None
        return self._adopt(worker)

    def _adopt(self, worker: Worker | None) -> Worker | None:
        if worker is not None:
            self.in_flight.enter_context(self.pool.placed(worker))
        return worker

    def _extend(
        self, worker: Worker, handle: WorkerHandle, tokens: list[int], keep: int, resumes: bool
    ) -> WorkerHandle:
        # Always: a round in flight when the previous call stopped may have run past the committed tokens.
        worker.stub.Truncate(
            common_pb2.TruncateRequest(session_id=handle.session_id, length=keep),
            timeout=self.rpc_timeout_s,
        )
        # a call with no new input (generation just continues) extends nothing
        if keep < len(tokens):
            response = worker.stub.Extend(
                common_pb2.ExtendRequest(
                    session_id=handle.session_id,
                    base_len=keep,
                    token_ids=tokens[keep:],
                    resumes_stream=resumes,
                ),
                timeout=self.deadline.remaining(),
            )
            self.stats.count_prefill(worker.pool, response.prefill_ns, len(tokens) - keep)
        return WorkerHandle(
            handle.worker_id, worker.address, handle.session_id, len(tokens), handle.drafter
        )

    def _open(self, worker: Worker, tokens: list[int], plan: Plan, resumes: bool) -> WorkerHandle:
        timeout = self.deadline.remaining()  # a prefill: it may queue behind other sessions'
        if worker.pool == TARGET:
            response = worker.stub.OpenSession(
                target_pb2.OpenSessionRequest(
                    prompt_token_ids=tokens,
                    sampling=sampling_to_proto(plan.params),
                    resumes_stream=resumes,
                ),
                timeout=timeout,
            )
        else:
            response = worker.stub.OpenSession(
                draft_pb2.DraftOpenSessionRequest(prompt_token_ids=tokens, drafter=plan.drafter),
                timeout=timeout,
            )
        self.stats.count_prefill(worker.pool, response.prefill_ns, len(tokens))
        handle = response.handle
        return WorkerHandle(
            handle.worker_id,
            worker.address,
            handle.session_id,
            handle.committed_len,
            plan.drafter if worker.pool == DRAFT else "",
        )

    def _truncate(self, worker: Worker, handle: WorkerHandle, length: int) -> None:
        """Absolute rollback: harmless when the worker already has exactly length."""
        try:
            worker.stub.Truncate(
                common_pb2.TruncateRequest(session_id=handle.session_id, length=length),
                timeout=self.rpc_timeout_s,
            )
            handle.committed_len = length
        except grpc.RpcError as error:
            # The next call re-syncs or re-prefills from the committed tokens.
            log.warning(
                "truncate on %s failed (%s); session will be re-synced",
                worker.address,
                error.code(),
            )
            handle.committed_len = min(handle.committed_len, length)
