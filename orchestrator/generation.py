"""One Generate call, top to bottom: plan it, place it on workers, stream its rounds as
chunks, then save the session (or close the new one its client left). The servicer only
translates this to and from the wire."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator

import grpc

from orchestrator.config import OrchestratorConfig
from orchestrator.failover import Failover
from orchestrator.generation_stats import CallStats
from orchestrator.placement import Placement, Placer
from orchestrator.planning import Plan, check_stop_strings, plan_call
from orchestrator.rounds import Generated, RoundStreams
from orchestrator.store import Lease, SessionRecord, SessionStore
from orchestrator.streaming import Chunk, TextStream
from orchestrator.text import TextAssembler
from orchestrator.workers import DRAFT, TARGET, WorkerPool, close_worker_sessions
from service_common.deadlines import Deadline
from specdec.v1 import orchestrator_pb2


class Generation:
    def __init__(
        self,
        config: OrchestratorConfig,
        pool: WorkerPool,
        store: SessionStore,
        tokenizer,
        request: orchestrator_pb2.GenerateRequest,
        context: grpc.ServicerContext,
        owner: str = "",
    ):
        self.config, self.pool, self.store, self.tokenizer = config, pool, store, tokenizer
        self.request, self.context = request, context
        self.owner = owner  # the API key's name: the session must be its, a new one becomes its
        self.stats = CallStats()
        # The client's deadline, passed on to every worker call that may queue under load.
        deadline = Deadline.of_caller(context, config.generate_timeout_s or None)
        self.session_id = request.session_id or uuid.uuid4().hex  # a new session if none
        self.is_new = not request.session_id
        self.closed = False  # the new session was closed: its client left
        self.placement, self.generated = Placement(), Generated()
        self._in_flight = contextlib.ExitStack()  # counts the call on its workers' load
        self.placer = Placer(config, pool, deadline, self.stats, self.placement, self._in_flight)
        self.streams = RoundStreams(context, deadline, self.placement, self.generated, self.stats)
        self.failover = Failover(
            config.max_failovers, context, self.placer, self.streams, self.generated, self.stats
        )

    def run(self) -> Iterator[Chunk]:
        check_stop_strings(self.config, self.request)
        with self.store.lease(self.session_id) as lease, self._in_flight:
            plan = plan_call(self.config, self.tokenizer, self.request, self._record())
            self.placer.place(plan)
            self.failover.sync(plan, plan.keep)
            try:
                yield from self._generate(plan, lease)
            finally:
                # A client gone after the commit, before the last chunk: a cancel frees the session it created.
                if self.is_new and not self.closed and not self.context.is_active():
                    self._close(plan.record, lease)

    def _record(self) -> SessionRecord:
        if self.is_new:
            return SessionRecord(self.session_id, [], owner=self.owner)
        return self.store.get_owned(self.session_id, self.owner)

    def _generate(self, plan: Plan, lease: Lease) -> Iterator[Chunk]:
        text = TextStream(self.tokenizer, self.request.stop, self.generated)
        try:
            finish = yield from text.chunks(
                self.failover.rounds(plan), self.context.is_active, self.streams.cancel
            )
        finally:
            self._commit(plan, text.assembler, lease)
        last = text.last_chunk()
        self.stats.end()
        last.finish_reason = finish
        last.stats = self.stats.to_proto() if self.request.include_stats else None
        last.num_prompt_tokens = len(plan.tokens)
        yield last

    def _commit(self, plan: Plan, assembler: TextAssembler, lease: Lease) -> None:
        """Saves the committed tokens and rolls both workers back to exactly them; a
        session this call created and its client cancelled is closed instead."""
        record = plan.record
        if self.is_new and not self.context.is_active():
            self._close(record, lease)
            return
        record.token_ids = plan.tokens + assembler.kept_tokens
        if self.request.WhichOneof("prompt") == "chat":
            record.messages.append({"role": "assistant", "content": assembler.text})
        self.placer.roll_back(
            record, cut_tokens=len(self.generated.token_ids) - len(assembler.kept_tokens)
        )
        record.last_used_ms = int(time.time() * 1000)
        if not record.sampling and self.request.HasField("sampling"):
            record.sampling = self.request.sampling.SerializeToString()
        self.store.put(record, lease)

    def _close(self, record: SessionRecord, lease: Lease) -> None:
        self.closed = True
        close_worker_sessions(
            self.pool, ((TARGET, record.target), (DRAFT, record.draft)), self.config.rpc_timeout_s
        )
        self.store.delete(record.session_id, lease)
