"""`specdec.v1.TargetService`: protos in, `TargetEngine` calls (target_service.engine), protos out; `Admission`
decides how many calls run at once. Handlers map the core's errors to gRPC statuses (`rpc_errors`); a proposal
that does not match its session is answered in-band (Verdict.discarded). Spans: `target_service.spans`."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Iterator

from opentelemetry import trace

from foundation.errors import InvalidArgument
from service_common import telemetry
from service_common.convert import (
    decision_to_proto,
    draft_probs_from_proto,
    lookup_rounds_from_proto,
    lookup_stop_from_proto,
    sampling_from_proto,
    step_load_to_proto,
    worker_load_to_proto,
)
from service_common.deadlines import time_remaining
from service_common.status import rpc_errors
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from speculative.sampling import SamplingParams
from target_service import spans
from target_service.admission import Admission
from target_service.engine import At, Discarded, Pass, TargetEngine
from target_service.served_tokenizer import served_tokenizer
from target_service.sessions import TargetSessions

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(
        self,
        sessions: TargetSessions,
        worker_id: str,
        model_info: common_pb2.ModelInfo,
        default_max_new_tokens: int,
        worker_address: str = "",
        admission: Admission | None = None,
    ):
        self.sessions = sessions
        self.engine = TargetEngine(sessions)
        self.admission = admission or Admission(max_running=sessions.max_sessions, max_queued=0)
        self.worker_id = worker_id
        self.worker_address = worker_address  # set once the server has bound its port
        self.model_info = model_info
        self.default_max_new_tokens = default_max_new_tokens
        telemetry.current().register_load_gauges(self._load, {"specdec.worker.id": worker_id})

    @rpc_errors
    def OpenSession(self, request, context):
        params = sampling_from_proto(request.sampling, self.default_max_new_tokens)
        session_id = request.session_id or uuid.uuid4().hex
        prompt_token_ids = list(request.prompt_token_ids)
        with (
            self._admitted(context) as waited_ns,
            spans.prefill(session_id, 0, len(prompt_token_ids)) as span,
        ):
            prefill_ns, _ = self.sessions.open(
                session_id, prompt_token_ids, params, request.resumes_stream
            )
            span.set_attributes(
                {"specdec.prefill_ns": prefill_ns, "specdec.admission_wait_ns": waited_ns}
            )
        log.debug(
            "opened session",
            extra={"fields": {"session_id": session_id, "prompt_len": len(prompt_token_ids)}},
        )
        handle = common_pb2.KvHandle(
            worker_id=self.worker_id,
            worker_address=self.worker_address,
            session_id=session_id,
            committed_len=len(prompt_token_ids),
        )
        return target_pb2.OpenSessionResponse(handle=handle, prefill_ns=prefill_ns)

    @rpc_errors
    def Extend(self, request, context):
        with (
            self._admitted(context) as waited_ns,
            spans.prefill(request.session_id, request.base_len, len(request.token_ids)) as span,
        ):
            committed_len, prefill_ns = self.engine.extend(
                At(request.session_id, request.base_len),
                list(request.token_ids),
                request.resumes_stream,
            )
            span.set_attributes(
                {"specdec.prefill_ns": prefill_ns, "specdec.admission_wait_ns": waited_ns}
            )
            return common_pb2.ExtendResponse(committed_len=committed_len, prefill_ns=prefill_ns)

    @rpc_errors
    def Verify(self, request_iterator, context):
        with contextlib.ExitStack() as admitted:
            for index, proposal in enumerate(request_iterator):
                # The stream takes its running slot with its first proposal.
                waited_ns = admitted.enter_context(self._admitted(context)) if index == 0 else 0
                if proposal.WhichOneof("kind") == "stretch":
                    yield from self._stretch(proposal, waited_ns, context)
                else:
                    yield self._verify(proposal, waited_ns)

    @rpc_errors
    def Decode(self, request, context):
        max_tokens = self.engine.start_decode(
            At(request.session_id, request.base_len), request.max_tokens, self._sampling(request)
        )
        with self._admitted(context) as waited_ns:
            passes = self.engine.decode(
                request.session_id, request.base_len, max_tokens, active=context.is_active
            )
            for one, step in _observed(passes, request.session_id, waited_ns):
                result = one.decoded.result
                yield target_pb2.DecodeToken(
                    token_id=result.token_ids[0],
                    committed_len=result.committed_len,
                    compute_ns=result.target_compute_ns,
                    step=step,
                )

    @rpc_errors
    def Truncate(self, request, context):
        return common_pb2.TruncateResponse(
            committed_len=self.engine.truncate(request.session_id, request.length)
        )

    @rpc_errors
    def CloseSession(self, request, context):
        # Idempotent (common.proto): closing an unknown or evicted session is not an error.
        if not self.sessions.close(request.session_id):
            log.debug(
                "close of unknown session", extra={"fields": {"session_id": request.session_id}}
            )
        return common_pb2.CloseSessionResponse()

    @rpc_errors
    def Info(self, request, context):
        return common_pb2.InfoResponse(
            worker_id=self.worker_id, model=self.model_info, load=worker_load_to_proto(self._load())
        )

    @rpc_errors
    def GetTokenizer(self, request, context):
        return self._served_tokenizer

    @functools.cached_property
    def _served_tokenizer(self) -> target_pb2.GetTokenizerResponse:
        return served_tokenizer(self.sessions.loaded)

    def _load(self) -> telemetry.WorkerLoad:
        load, admission = self.sessions.load(), self.admission.load()
        return telemetry.WorkerLoad(
            active_sessions=load.active_sessions,
            max_sessions=self.sessions.max_sessions,
            cached_tokens=load.cached_tokens,
            max_cached_tokens=self.sessions.max_cached_tokens,
            running_calls=admission.running,
            queued_calls=admission.queued,
            max_running=self.admission.max_running,
            mean_batch_tokens=self.sessions.compute.occupancy(),
            max_batch_tokens=self.sessions.compute.max_batch_tokens,
        )

    @contextlib.contextmanager
    def _admitted(self, context) -> Iterator[int]:
        """A running slot for the call (see Admission); yields how long it waited for it (ns)."""
        waited_ns = self.admission.acquire(time_remaining(context))
        try:
            yield waited_ns
        finally:
            self.admission.release()

    # Verify: one proposal -> one verdict, or a verdict per pass of a stretch.

    def _verify(self, proposal: target_pb2.Proposal, waited_ns: int) -> target_pb2.Verdict:
        start_ns = time.perf_counter_ns()
        draft = proposal.draft
        sampling = self._sampling(proposal)
        draft_probs = draft_probs_from_proto(draft)
        with tracer.start_as_current_span(telemetry.VERIFY_SPAN) as span:
            try:
                verified = self.engine.verify(
                    _at(proposal),
                    list(draft.token_ids),
                    draft_probs,
                    sampling,
                    list(draft.parents) or None,
                )
                step = step_load_to_proto(verified.load, waited_ns)
                verdict = _echo(
                    proposal,
                    decision=decision_to_proto(verified.result, verified.context_length, step),
                )
                verdict.decision.target_handled_ns = time.perf_counter_ns() - start_ns
            except Discarded as stale:
                verdict = _echo(proposal, discarded=stale)
            spans.verified(span, proposal, verdict)
        return verdict

    def _stretch(
        self, proposal: target_pb2.Proposal, waited_ns: int, context
    ) -> Iterator[target_pb2.Verdict]:
        stretch = proposal.stretch
        if stretch.max_tokens < 1:
            raise InvalidArgument(f"stretch.max_tokens must be >= 1, got {stretch.max_tokens}")
        until = (
            lookup_stop_from_proto(stretch.until_lookup)
            if stretch.HasField("until_lookup")
            else None
        )
        lookup = (
            lookup_rounds_from_proto(stretch.lookup_rounds)
            if stretch.HasField("lookup_rounds")
            else None
        )
        try:
            context_length = self.engine.start_stretch(_at(proposal), self._sampling(proposal))
        except Discarded as stale:
            yield _echo(proposal, discarded=stale)
            return
        passes = self.engine.decode(
            proposal.session_id,
            proposal.base_len,
            stretch.max_tokens,
            until,
            lookup,
            active=context.is_active,
        )
        for one, step in _observed(passes, proposal.session_id, waited_ns, proposal.round):
            yield _stretch_pass(proposal, one, context_length, step)

    def _sampling(self, request) -> SamplingParams | None:
        if not request.HasField("sampling"):
            return None  # the session's params stay
        return sampling_from_proto(request.sampling, self.default_max_new_tokens)


def _observed(
    passes: Iterator[Pass], session_id: str, waited_ns: int, round_index: int | None = None
) -> Iterator[tuple[Pass, common_pb2.StepLoad]]:
    """Each pass with its step, in a span and in the time per output token (a pass may
    commit several tokens); admission's wait counts in the first's step."""
    output = telemetry.OutputTiming()  # on the time_ns clock of Decoded.emitted_ns
    try:
        for one in passes:
            step = step_load_to_proto(one.load, 0 if output.num_tokens else waited_ns)
            output.add(len(one.decoded.result.token_ids), one.decoded.emitted_ns)
            spans.decode(session_id, one, step, round_index)
            yield one, step
    finally:
        output.record()


def _echo(
    proposal: target_pb2.Proposal, discarded: Discarded | None = None, **fields
) -> target_pb2.Verdict:
    """A verdict echoing the proposal's identity; `discarded`: the in-band answer to a stale one."""
    if discarded is not None:
        fields["discarded"] = target_pb2.Discarded(committed_len=discarded.committed_len)
    return target_pb2.Verdict(
        session_id=proposal.session_id, round=proposal.round, base_len=proposal.base_len, **fields
    )


def _at(proposal: target_pb2.Proposal) -> At:
    expected = (
        proposal.expected_last_token_id if proposal.HasField("expected_last_token_id") else None
    )
    return At(proposal.session_id, proposal.base_len, expected)


def _stretch_pass(
    proposal: target_pb2.Proposal, one: Pass, context_length: int, step: common_pb2.StepLoad
) -> target_pb2.Verdict:
    """A verdict on one pass of a stretch, from the length before it."""
    result = one.decoded.result
    ended = (
        one.decoded.ends or result.committed_len - proposal.base_len >= proposal.stretch.max_tokens
    )
    stretch_pass = target_pb2.StretchPass(
        decision=decision_to_proto(result, context_length, step),
        ended=ended,
        num_looked_up=result.num_drafted,
        accepted_token_ids=one.decoded.accepted,
    )
    verdict = _echo(proposal, stretch_pass=stretch_pass)
    verdict.base_len = result.committed_len - len(result.token_ids)
    return verdict
