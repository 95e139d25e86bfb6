"""The DraftService RPCs: thin wrappers over the session cache, the drafters and the
speculation loop. Errors are typed (foundation.errors, service_common.status) and turned
into statuses by `rpc_errors`; a target's error status is passed on unchanged."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import grpc
from opentelemetry import trace

from draft_service.config import DraftConfig
from draft_service.drafting import Drafters, prefill
from draft_service.round_times import DraftVerifyWindow
from draft_service.sessions import SessionEntry
from draft_service.speculation import SpeculateCall
from draft_service.target_connections import TargetConnections
from foundation.errors import InvalidArgument, StaleProposal
from model_runtime.fingerprint import ANY_VOCABULARY
from service_common import telemetry
from service_common.convert import model_info
from service_common.deadlines import Deadline, bounded, time_remaining
from service_common.session_cache import SessionCache
from service_common.status import SessionBusy, rpc_errors
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from speculative.types import MODEL

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(
        self,
        config: DraftConfig,
        drafters: Drafters,
        sessions: SessionCache[SessionEntry],
        targets: TargetConnections,
    ):
        self.config = config
        self.drafters = drafters
        self.sessions = sessions
        self.targets = targets
        self.worker_id = config.resolved_worker_id()
        self.advertise_address = config.advertise_address  # set by create_server once bound
        self.round_times = DraftVerifyWindow()  # every call's rounds: the HPA's ratio
        telemetry.current().register_load_gauges(self._load, {"specdec.worker.id": self.worker_id})

    # --- sessions ---------------------------------------------------------------------

    @rpc_errors
    def OpenSession(self, request, context):
        drafter = self.drafters.resolve(request.drafter)
        session_id = request.session_id or uuid.uuid4().hex
        prompt = list(request.prompt_token_ids)
        self.drafters.check_tokens(drafter, 0, prompt)
        self.sessions.check_new(session_id)
        self.sessions.make_room(len(prompt))
        with _prefill_span(session_id, 0, len(prompt)) as span:
            start = time.perf_counter_ns()
            draft = self.drafters.open(drafter, prompt)
            prefill_ns = time.perf_counter_ns() - start
            span.set_attribute("specdec.prefill_ns", prefill_ns)
        self.sessions.add(SessionEntry(session_id, drafter, draft))
        return draft_pb2.DraftOpenSessionResponse(
            handle=self._handle(session_id, len(prompt)), prefill_ns=prefill_ns
        )

    @rpc_errors
    def Extend(self, request, context):
        with self._locked(request.session_id, context) as entry:
            if request.base_len != entry.length:
                raise StaleProposal(
                    f"Extend at length {request.base_len}, but draft session {request.session_id!r} "
                    f"holds {entry.length} committed tokens"
                )
            token_ids = list(request.token_ids)
            self.drafters.check_tokens(entry.drafter, entry.length, token_ids)
            self.sessions.make_room(len(token_ids), keep=entry)
            with _prefill_span(request.session_id, request.base_len, len(token_ids)) as span:
                start = time.perf_counter_ns()
                entry.draft.append(token_ids)
                prefill(entry.draft)
                prefill_ns = time.perf_counter_ns() - start
                span.set_attribute("specdec.prefill_ns", prefill_ns)
            return common_pb2.ExtendResponse(committed_len=entry.length, prefill_ns=prefill_ns)

    @rpc_errors
    def Truncate(self, request, context):
        with self._locked(request.session_id, context) as entry:
            if not 1 <= request.length <= entry.length:
                raise InvalidArgument(
                    f"truncate length must be in [1, {entry.length}] (the committed length of draft "
                    f"session {request.session_id!r}), got {request.length}"
                )
            entry.draft.truncate_to(request.length)
            return common_pb2.TruncateResponse(committed_len=entry.length)

    @rpc_errors
    def CloseSession(self, request, context):
        try:
            self.sessions.close(request.session_id, self._session_wait_s(context))
        except SessionBusy as error:
            context.abort(grpc.StatusCode.ABORTED, str(error))
        return common_pb2.CloseSessionResponse()

    @rpc_errors
    def Info(self, request, context):
        if MODEL in self.drafters.by_name:
            model = model_info(self.drafters.loaded, self.config.device)
        else:
            model = common_pb2.ModelInfo(model_id="ngram", tokenizer_fingerprint=ANY_VOCABULARY)
        load = self._load()
        return common_pb2.InfoResponse(
            worker_id=self.worker_id,
            model=model,
            load=common_pb2.WorkerLoad(
                active_sessions=load.active_sessions,
                max_sessions=load.max_sessions,
                cached_tokens=load.cached_tokens,
                max_cached_tokens=load.max_cached_tokens,
            ),
        )

    # --- the speculation loop ---------------------------------------------------------

    @rpc_errors
    def Speculate(self, request, context):
        cancelled = threading.Event()
        context.add_callback(cancelled.set)  # the caller cancelled, or its deadline passed
        call = SpeculateCall(request, self.config, self.drafters, self.targets, self.round_times)
        with self._locked(request.session_id, context) as entry:
            yield from call.run(
                entry,
                Deadline.of_caller(context),
                cancelled=lambda: cancelled.is_set() or not context.is_active(),
            )

    # --- helpers ----------------------------------------------------------------------

    def _load(self) -> telemetry.WorkerLoad:
        load = self.sessions.load()
        return telemetry.WorkerLoad(
            active_sessions=load.active_sessions,
            max_sessions=self.sessions.max_sessions,
            cached_tokens=load.cached_tokens,
            max_cached_tokens=self.sessions.max_cached_tokens,
            draft_verify_time_ratio=self.round_times.ratio(),
        )

    def _handle(self, session_id: str, committed_len: int) -> common_pb2.KvHandle:
        return common_pb2.KvHandle(
            worker_id=self.worker_id,
            worker_address=self.advertise_address,
            session_id=session_id,
            committed_len=committed_len,
        )

    def _session_wait_s(self, context) -> float:
        """How long a call may wait for its session: the caller's deadline, at most
        session_wait_timeout_s."""
        return bounded(time_remaining(context), self.config.session_wait_timeout_s)

    def _locked(self, session_id: str, context):
        """The session, held for the block; ABORTED if another call holds it too long."""
        return _AbortWhenBusy(
            self.sessions.locked(session_id, self._session_wait_s(context)), context
        )


def _prefill_span(session_id: str, base_len: int, num_tokens: int):
    """A specdec.prefill span around new input entering a draft session."""
    return tracer.start_as_current_span(
        telemetry.PREFILL_SPAN,
        attributes={
            "specdec.session_id": session_id,
            "specdec.base_len": base_len,
            "specdec.tokens": num_tokens,
        },
    )


class _AbortWhenBusy:
    """Wraps SessionCache.locked: a busy session is ABORTED here (retry after the other
    call, which this one waited for), not the FAILED_PRECONDITION of the status table."""

    def __init__(self, locked, context):
        self._locked = locked
        self._context = context

    def __enter__(self) -> SessionEntry:
        try:
            return self._locked.__enter__()
        except SessionBusy as error:
            self._context.abort(grpc.StatusCode.ABORTED, str(error))

    def __exit__(self, *exc_info):
        return self._locked.__exit__(*exc_info)
