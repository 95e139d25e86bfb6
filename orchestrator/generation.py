"""One Generate call: resolve the session, place it on workers, stream rounds, stop,
roll back, save. The servicer only translates this to and from the wire."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from service_common.convert import (
    FINISH_REASON_TO_PROTO,
    generation_stats_to_proto,
    round_stats_from_proto,
    sampling_from_proto,
    sampling_to_proto,
    step_load_from_proto,
)
from service_common.deadlines import Deadline
from service_common.telemetry import instruments
from specdec.v1 import common_pb2, draft_pb2, orchestrator_pb2, target_pb2
from speculative.errors import InvalidArgument
from speculative.limits import validate_num_speculative_tokens
from speculative.stats import GenerationStats, RoundStats
from speculative.types import FinishReason, NextTokenKind, SamplingParams, check_drafter_name
from orchestrator.config import OrchestratorConfig
from orchestrator.limits import check_max_new_tokens, check_prompt_tokens
from orchestrator.store import Lease, SessionRecord, SessionStore, WorkerHandle
from orchestrator.text import TextAssembler, common_prefix_length, render_chat
from orchestrator.workers import DRAFT, TARGET, Worker, WorkerPool, close_worker_sessions

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

# The orchestrator's spans, children of the Generate server span (read by `python -m report`).
FAILOVER_SPAN = "specdec.failover"  # a lost worker replaced, the session re-synced
ROLLBACK_SPAN = "specdec.rollback"  # both workers truncated to the committed tokens

STOP_STRING = common_pb2.FINISH_REASON_STOP_STRING
CANCELLED = common_pb2.FINISH_REASON_CANCELLED
# A worker lost (killed, partitioned) or a session evicted mid-call: the call goes on
# from the committed tokens on another worker, or the same one re-prefilled.
FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
PROBE_TIMEOUT_S = 2.0  # a live worker answers Info at once
SEED_STRIDE = 0x9E3779B97F4A7C15  # odd, so seeds moved on by different counts differ


@dataclass
class Chunk:
    token_ids: list[int]
    text_delta: str
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED  # set on the last chunk
    stats: common_pb2.GenerationStats | None = None  # on the last chunk
    sources: list[int] = field(default_factory=list)  # TokenSource of each of token_ids
    texts: list[str] = field(default_factory=list)  # the part of text_delta of each of token_ids
    num_drafted: int = 0  # draft tokens of the rounds that end in this chunk
    num_prompt_tokens: int = 0  # on the last chunk


def token_sources(round_stats: common_pb2.RoundStats) -> list[int]:
    """How each token a round committed was produced: its accepted draft tokens, then the
    target's recovered or bonus token; a round that drafted nothing (a token of a
    stretch, or a drafter with no proposal) is the target's alone. A stretch's pass
    that verified prompt lookup's tokens is a round."""
    if round_stats.num_drafted == 0:
        return [orchestrator_pb2.TOKEN_SOURCE_TARGET]
    last = (orchestrator_pb2.TOKEN_SOURCE_RECOVERED
            if round_stats.next_token_kind == common_pb2.NEXT_TOKEN_KIND_RECOVERED else orchestrator_pb2.TOKEN_SOURCE_BONUS)
    return [orchestrator_pb2.TOKEN_SOURCE_ACCEPTED] * round_stats.num_accepted + [last]


@dataclass
class Plan:
    """What a call will do, decided before any worker is touched."""

    record: SessionRecord
    tokens: list[int]  # the full sequence to generate after: history + new input
    keep: int  # committed tokens of the record that stay (the rest is rolled back)
    params: SamplingParams
    k: int
    drafter: str
    adaptive: bool


class Generation:
    def __init__(self, config: OrchestratorConfig, pool: WorkerPool, store: SessionStore, tokenizer,
                 request: orchestrator_pb2.GenerateRequest, context: grpc.ServicerContext, owner: str = ""):
        self.config, self.pool, self.store, self.tokenizer = config, pool, store, tokenizer
        self.request, self.context = request, context
        self.owner = owner  # the API key's name: the session must be its, a new one becomes its
        self.stats = GenerationStats()
        self.num_prefill_tokens = 0  # tokens the target prefilled for this call
        self.num_failovers = 0
        self.start_ns = time.perf_counter_ns()
        # The client's deadline, passed on to every worker call that may queue under load.
        self.deadline = Deadline.of_caller(context, config.generate_timeout_s or None)
        self.call = None  # the streaming call to a worker, cancelled with the client's
        self.session_id = request.session_id or uuid.uuid4().hex  # a new session if none
        self.is_new = not request.session_id
        self.closed = False  # the new session was closed: its client left
        self.target: Worker | None = None  # the workers serving the call, as placed
        self.draft: Worker | None = None
        self.generated: list[int] = []  # tokens received from the workers (committed by the target)
        self.sources: list[int] = []  # how each token was produced (TokenSource), aligned with generated
        self.drafted: list[int] = []  # per token: the draft tokens of the round it ends, else 0
        self.synced_len = 0  # tokens both workers certainly hold (base of the last stream)
        self._in_flight = contextlib.ExitStack()  # counts the call on its workers' load

    def run(self) -> Iterator[Chunk]:
        self._check_stop_strings()
        with self.store.lease(self.session_id) as lease, self._in_flight:
            record = (SessionRecord(self.session_id, [], owner=self.owner) if self.is_new
                      else self.store.get_owned(self.session_id, self.owner))
            plan = self._plan(record)
            self._place(plan)
            try:
                yield from self._generate(plan, lease)
            finally:
                # A client that cancels after the commit, before it has the last chunk,
                # gets what a cancelled call promises: the session it created is freed.
                if self.is_new and not self.closed and not self.context.is_active():
                    self._close(plan.record, lease)

    # 1. Plan: parameters, the new input, the room left in the context.

    def _plan(self, record: SessionRecord) -> Plan:
        params = self._sampling(record)
        speculation = self._speculation(record)
        tokens, keep = self._tokens(record)
        if not tokens:
            raise InvalidArgument("prompt is empty: give text, token ids or chat messages")
        check_prompt_tokens(self.config, len(tokens))
        check_max_new_tokens(self.config, params.max_new_tokens)
        k = speculation.num_speculative_tokens if speculation.HasField("num_speculative_tokens") else self.config.default_k
        return Plan(record, tokens, keep, params, validate_num_speculative_tokens(k),
                    speculation.drafter, speculation.adaptive)

    def _sampling(self, record: SessionRecord) -> SamplingParams:
        message = common_pb2.SamplingParams()
        if record.sampling:
            message.ParseFromString(record.sampling)
        if self.request.HasField("sampling"):
            message = self.request.sampling
        params = sampling_from_proto(message, self.config.default_max_new_tokens)
        # The end-of-text token always ends generation, as users of every server expect.
        eos = self.tokenizer.eos_token_id
        if eos is not None and eos not in params.stop_token_ids:
            params = params.replace(stop_token_ids=(*params.stop_token_ids, eos))
        return params

    def _speculation(self, record: SessionRecord) -> common_pb2.SpeculationParams:
        message = common_pb2.SpeculationParams()
        if record.speculation:
            message.ParseFromString(record.speculation)
        if self.request.HasField("speculation"):
            message = self.request.speculation
        check_drafter_name(message.drafter)
        return message

    def _tokens(self, record: SessionRecord) -> tuple[list[int], int]:
        """The sequence to continue from, and how much of the committed one it keeps."""
        kind = self.request.WhichOneof("prompt")
        history = record.token_ids
        if kind == "chat":
            messages = [*record.messages, *({"role": m.role, "content": m.content} for m in self.request.chat.messages)]
            tokens = render_chat(self.tokenizer, messages)
            record.messages = messages
            # Rendering the whole conversation keeps the session equal to a fresh one;
            # the common prefix keeps its KV cache.
            return tokens, common_prefix_length(history, tokens)
        if kind == "text":
            new = self.tokenizer(self.request.text, add_special_tokens=not history).input_ids
        elif kind == "token_ids":
            new = list(self.request.token_ids.ids)
        else:
            new = []
        return history + new, len(history)

    def _check_stop_strings(self) -> None:
        stops = self.request.stop
        if len(stops) > self.config.max_stop_strings:
            raise InvalidArgument(f"at most {self.config.max_stop_strings} stop strings (max_stop_strings), "
                                  f"got {len(stops)}")
        for stop in stops:
            if not stop or len(stop) > self.config.max_stop_string_chars:
                raise InvalidArgument(
                    f"stop strings must have 1 to {self.config.max_stop_string_chars} characters "
                    f"(max_stop_string_chars), got {len(stop)}"
                )

    # 2. Place: a target (and a draft) session holding exactly the committed tokens.

    def _place(self, plan: Plan) -> None:
        """Keeps the session on the workers that hold its caches when they are alive
        (affinity), else the least-loaded ones; a worker that fails while being synced
        is replaced like one lost mid-generation."""
        record = plan.record
        self.target = self._worker_for(record.target, TARGET) or self._adopt(self.pool.pick_target())
        self._check_room(plan, self.target)
        if plan.k > 0:
            self.draft = self._worker_for(record.draft, DRAFT) or self._adopt(self.pool.pick_draft(self.target, plan.drafter))
            if self.draft is None:  # an empty draft pool: the target decodes alone
                instruments().fallbacks.add(1)
        self._sync_all(plan, plan.keep)

    def _check_room(self, plan: Plan, target: Worker) -> None:
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
                raise InvalidArgument(f"token id {token} is outside the vocabulary [0, {target.model.vocab_size})")

    def _worker_for(self, handle: WorkerHandle | None, pool: str) -> Worker | None:
        """The worker that already holds the session's cache, if it is still there."""
        worker = self.pool.by_address(pool, handle.address) if handle else None
        return self._adopt(worker)

    def _adopt(self, worker: Worker | None) -> Worker | None:
        if worker is not None:
            self._in_flight.enter_context(self.pool.placed(worker))
        return worker

    def _sync_all(self, plan: Plan, keep: int) -> None:
        """Brings target and draft to exactly the committed tokens, replacing a worker
        that turns out to be unreachable (at most max_failovers times)."""
        tokens = self._committed(plan)
        synced: set[tuple[str, str]] = set()  # (pool, address): done, not redone on a retry
        while True:
            try:
                for worker, field in ((self.target, "target"), (self.draft, "draft")):
                    if worker is None or (worker.pool, worker.address) in synced:
                        continue
                    setattr(plan.record, field, self._sync(worker, getattr(plan.record, field), tokens, keep, plan))
                    synced.add((worker.pool, worker.address))
                break
            except grpc.RpcError as error:
                self._replace_lost_workers(plan, error)
        self.synced_len = len(tokens)

    def _sync(self, worker: Worker, handle: WorkerHandle | None, tokens: list[int], keep: int, plan: Plan) -> WorkerHandle:
        """Rolls the worker's session back to what it shares with tokens, then extends
        it; opens (prefills) a new one where it has none, lost it, or shares nothing.
        Truncate is bookkeeping (rpc_timeout_s); Extend prefills, under the call's deadline."""
        timeout = self.config.rpc_timeout_s
        if handle and handle.address == worker.address and worker.pool == DRAFT and handle.drafter != plan.drafter:
            # A draft session keeps the drafter it was opened with: another one needs a new session.
            close_worker_sessions(self.pool, ((worker.pool, handle),), timeout)
            return self._open(worker, tokens, plan)
        if handle and handle.address == worker.address:
            keep = min(keep, handle.committed_len)
            if keep < 1:  # nothing in common (a session keeps at least one token)
                close_worker_sessions(self.pool, ((worker.pool, handle),), timeout)
                return self._open(worker, tokens, plan)
            try:
                # Always: the worker may have run past the committed tokens (a round in
                # flight when the previous call stopped); rollback is absolute.
                worker.stub.Truncate(common_pb2.TruncateRequest(session_id=handle.session_id, length=keep), timeout=timeout)
                if keep < len(tokens):  # a call with no new input (generation just continues) extends nothing
                    response = worker.stub.Extend(common_pb2.ExtendRequest(
                        session_id=handle.session_id, base_len=keep, token_ids=tokens[keep:]),
                        timeout=self.deadline.remaining())
                    self._count_prefill(worker, response.prefill_ns, len(tokens) - keep)
                return WorkerHandle(handle.worker_id, worker.address, handle.session_id, len(tokens), handle.drafter)
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                log.info("session %s evicted from %s: re-prefilling", handle.session_id, worker.address)
        return self._open(worker, tokens, plan)

    def _open(self, worker: Worker, tokens: list[int], plan: Plan) -> WorkerHandle:
        timeout = self.deadline.remaining()  # a prefill: it may queue behind other sessions'
        if worker.pool == TARGET:
            response = worker.stub.OpenSession(target_pb2.OpenSessionRequest(
                prompt_token_ids=tokens, sampling=sampling_to_proto(plan.params)), timeout=timeout)
        else:
            response = worker.stub.OpenSession(draft_pb2.DraftOpenSessionRequest(
                prompt_token_ids=tokens, drafter=plan.drafter), timeout=timeout)
        self._count_prefill(worker, response.prefill_ns, len(tokens))
        handle = response.handle
        return WorkerHandle(handle.worker_id, worker.address, handle.session_id, handle.committed_len,
                            plan.drafter if worker.pool == DRAFT else "")

    def _count_prefill(self, worker: Worker, prefill_ns: int, num_tokens: int) -> None:
        self.stats.prefill_ns += prefill_ns
        if worker.pool == TARGET:
            self.num_prefill_tokens += num_tokens

    # 3. Failover: a worker lost mid-call is replaced; the call goes on from the
    # committed tokens, so the client sees no token lost or repeated.

    def _replace_lost_workers(self, plan: Plan, error: grpc.RpcError) -> None:
        """Finds which worker is gone and replaces it: the target by another target
        (re-prefilled), the draft by another draft or, with none left, by target-only
        decoding. Raises the error when it is not a lost worker or failovers ran out."""
        if (error.code() not in FAILOVER_CODES or self.num_failovers >= self.config.max_failovers
                or not self.context.is_active()):
            raise error
        self.num_failovers += 1
        with tracer.start_as_current_span(FAILOVER_SPAN) as span:
            lost = [w for w in (self.target, self.draft) if w is not None and not self._answers(w)]
            log.warning("failover %d of session %s after %s (%s): lost %s", self.num_failovers, self.session_id,
                        error.code().name, error.details(), [w.address for w in lost] or "none, re-syncing")
            span.set_attributes({
                "specdec.error": error.code().name, "specdec.committed_len": len(self._committed(plan)),
                "specdec.lost": [f"{w.pool}:{w.address}" for w in lost],
            })
            for worker in lost:
                self.pool.suspect(worker)
                instruments().failovers.add(1, {"pool": worker.pool})
            if self.target in lost:
                plan.record.target = None
                self.target = self._adopt(self.pool.pick_target())
            if self.draft in lost:
                plan.record.draft = None
                self.draft = self._adopt(self.pool.pick_draft(self.target, plan.drafter))
                if self.draft is None:
                    log.warning("no draft worker left: session %s goes on with target-only decoding", self.session_id)
                    instruments().fallbacks.add(1)
            span.set_attribute("specdec.target", self.target.address)
            span.set_attribute("specdec.draft", self.draft.address if self.draft else "")

    def _answers(self, worker: Worker) -> bool:
        try:
            worker.stub.Info(common_pb2.InfoRequest(), timeout=PROBE_TIMEOUT_S)
            return True
        except grpc.RpcError:
            return False

    def _committed(self, plan: Plan) -> list[int]:
        return plan.tokens + self.generated

    def _committed_len(self, plan: Plan) -> int:
        return len(plan.tokens) + len(self.generated)

    # 4. Generate: stream rounds, stop, roll back, save.

    def _generate(self, plan: Plan, lease: Lease) -> Iterator[Chunk]:
        assembler = TextAssembler(self.tokenizer, self.request.stop)
        finish = common_pb2.FINISH_REASON_UNSPECIFIED
        sent = 0  # tokens released to the client so far

        def chunk(released: list[int], delta: str, *last) -> Chunk:
            nonlocal sent
            begin, sent = sent, sent + len(released)
            return Chunk(released, delta, *last, sources=self.sources[begin:sent], texts=assembler.pieces,
                         num_drafted=sum(self.drafted[begin:sent]))

        try:
            for token_ids, finish in self._rounds_with_failover(plan):
                released, delta = assembler.add(token_ids)
                stopped = assembler.stopped_at is not None
                if stopped:
                    self.call.cancel()
                    finish = STOP_STRING
                if released or delta:  # on a stop too: the text before it in this round
                    yield chunk(released, delta)
                if stopped:
                    break
                if not self.context.is_active():
                    finish = CANCELLED
                    break
        finally:
            self._commit(plan, assembler, lease)
        released, delta = assembler.finish()
        self.stats.total_ns = time.perf_counter_ns() - self.start_ns
        if self.generated:
            instruments().time_per_output_token.record(self.stats.total_ns * 1e-9 / len(self.generated))
        last = chunk(released, delta, finish, self._stats_proto())
        last.num_prompt_tokens = len(plan.tokens)
        yield last

    def _rounds_with_failover(self, plan: Plan):
        """The rounds of _rounds; when a worker is lost, the remaining ones from new workers."""
        while True:
            try:
                for token_ids, finish in self._rounds(plan):
                    self.generated.extend(token_ids)
                    yield token_ids, finish
                    if finish:
                        return
                return
            except grpc.RpcError as error:
                self._replace_lost_workers(plan, error)
                self._sync_all(plan, self.synced_len)

    def _rounds(self, plan: Plan):
        """(token_ids, finish_reason) per round (or per token the target decodes alone)
        from one Speculate stream or, without a draft, one Decode stream."""
        if self.draft is None:
            yield from self._decode_alone(plan)
        else:
            yield from self._speculate(plan)

    def _speculate(self, plan: Plan):
        """Yields the rounds of one Speculate stream. It restarts the target's generator
        from the seed it is sent: moved on by the tokens drawn so far after a failover,
        never the same draws."""
        record = plan.record
        base_len = self._committed_len(plan)
        speculation = common_pb2.SpeculationParams(
            num_speculative_tokens=plan.k, drafter=plan.drafter, adaptive=plan.adaptive)
        self.call = self.draft.stub.Speculate(draft_pb2.SpeculateRequest(
            session_id=record.draft.session_id, base_len=base_len,
            target=common_pb2.KvHandle(worker_id=record.target.worker_id, worker_address=self.target.address,
                                       session_id=record.target.session_id, committed_len=base_len),
            sampling=sampling_to_proto(self._remaining_params(plan.params)), speculation=speculation),
            timeout=self.deadline.remaining())
        self.context.add_callback(self.call.cancel)
        for update in self.call:
            record.draft.committed_len = update.committed_len  # the draft holds each round's tokens
            self.stats.record_round(round_stats_from_proto(update.round, len(update.token_ids)))
            sources = token_sources(update.round)[: len(update.token_ids)]
            self.sources += sources
            self.drafted += [0] * (len(sources) - 1) + [update.round.num_drafted]
            yield list(update.token_ids), update.finish_reason

    def _decode_alone(self, plan: Plan):
        """Target-only decoding: one Decode stream up to max_new_tokens, with the call's
        sampling."""
        request = target_pb2.DecodeRequest(session_id=plan.record.target.session_id,
                                           base_len=self._committed_len(plan),
                                           sampling=sampling_to_proto(self._remaining_params(plan.params)))
        self.call = self.target.stub.Decode(request, timeout=self.deadline.remaining())
        self.context.add_callback(self.call.cancel)
        for token in self.call:
            self.stats.record_round(RoundStats(
                index=self.stats.num_rounds, base_len=token.committed_len - 1, num_drafted=0, num_accepted=0,
                num_committed=1, next_token_kind=NextTokenKind.BONUS, draft_ns=0, verify_ns=token.compute_ns,
                target_compute_ns=token.compute_ns, step=step_load_from_proto(token.step)))
            self.sources.append(orchestrator_pb2.TOKEN_SOURCE_TARGET)
            self.drafted.append(0)
            yield [token.token_id], self._finish_of_decode(plan.params, len(self.generated) + 1, token.token_id)

    def _remaining_params(self, params: SamplingParams) -> SamplingParams:
        """The call's params for what is left after a failover: the remaining token
        budget, and a seed moved on by the tokens already drawn. Workers restart their
        generator from the seed they are sent; restarting from the request's own seed
        would reuse the random draws of the first tokens for the next ones."""
        if not self.generated:
            return params
        remaining = params.replace(max_new_tokens=params.max_new_tokens - len(self.generated))
        if params.seed is None:
            return remaining
        return remaining.replace(seed=(params.seed + SEED_STRIDE * len(self.generated)) % 2**63)

    def _finish_of_decode(self, params: SamplingParams, count: int, token: int) -> int:
        if token in params.stop_token_ids:
            return FINISH_REASON_TO_PROTO[FinishReason.STOP_TOKEN]
        return FINISH_REASON_TO_PROTO[FinishReason.LENGTH] if count == params.max_new_tokens else 0

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
        with tracer.start_as_current_span(ROLLBACK_SPAN) as span:
            span.set_attributes({"specdec.committed_len": len(record.token_ids),
                                 "specdec.cut_tokens": len(self.generated) - len(assembler.kept_tokens)})
            for worker, handle in ((self.target, record.target), (self.draft, record.draft)):
                if worker is not None and handle is not None:
                    # A draft left behind (its stream failed over to the target alone)
                    # keeps what it holds: the next call extends it.
                    length = len(record.token_ids)
                    self._truncate(worker, handle, min(length, handle.committed_len) if worker is self.draft else length)
        record.last_used_ms = int(time.time() * 1000)
        if not record.sampling and self.request.HasField("sampling"):
            record.sampling = self.request.sampling.SerializeToString()
        self.store.put(record, lease)

    def _close(self, record: SessionRecord, lease: Lease) -> None:
        self.closed = True
        close_worker_sessions(self.pool, ((TARGET, record.target), (DRAFT, record.draft)),
                              self.config.rpc_timeout_s)
        self.store.delete(record.session_id, lease)

    def _truncate(self, worker: Worker, handle: WorkerHandle, length: int) -> None:
        """Absolute rollback: harmless when the worker already has exactly length."""
        try:
            worker.stub.Truncate(common_pb2.TruncateRequest(session_id=handle.session_id, length=length),
                                 timeout=self.config.rpc_timeout_s)
            handle.committed_len = length
        except grpc.RpcError as error:
            # The next call re-syncs or re-prefills from the committed tokens.
            log.warning("truncate on %s failed (%s); session will be re-synced", worker.address, error.code())
            handle.committed_len = min(handle.committed_len, length)

    def _stats_proto(self) -> common_pb2.GenerationStats | None:
        if not self.request.include_stats:
            return None
        s = self.stats
        orchestrator_ns = max(0, s.total_ns - s.prefill_ns - s.draft_ns - s.verify_ns)
        stats = generation_stats_to_proto(s, orchestrator_ns, self.num_prefill_tokens)
        stats.num_failovers = self.num_failovers
        return stats
