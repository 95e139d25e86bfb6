"""`specdec.v1.TargetService`: protos in, core calls, protos out.

The logic lives in `speculative.target.TargetSession` (verification, rollback),
`target_service.sessions.SessionCache` (budget, eviction, locks), the step scheduler
that batches every session's forward passes (model_runtime.step_scheduler) and
`target_service.admission.Admission` (how many calls run at once); every handler maps
the core's errors to gRPC statuses through `rpc_errors`.

Spans (service_common.telemetry; no-ops when telemetry is off): `specdec.prefill` in
OpenSession and Extend, `specdec.verify` per proposal (a child of the Verify server
span), `specdec.decode` per token the target decodes alone (a Decode stream, or a
stretch on a Verify stream).
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from opentelemetry import trace

from model_runtime.loading import LoadedModel
from model_runtime.model_session import Emit, ForwardSteps
from model_runtime.step_scheduler import StepLoad
from service_common import telemetry
from service_common.convert import (
    NEXT_TOKEN_KIND_TO_PROTO,
    lookup_rounds_from_proto,
    lookup_stop_from_proto,
    sampling_from_proto,
    sparse_from_proto,
)
from service_common.deadlines import time_remaining
from service_common.status import FailedPrecondition, rpc_errors
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from speculative.errors import InvalidArgument, StaleProposal
from speculative.prompt_lookup import LookupRounds, LookupStop
from speculative.sampling import SamplingParams
from speculative.target import TargetSession, VerifyResult
from target_service.admission import Admission
from target_service.sessions import SessionCache

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

# Tokens a Decode stream or a stretch decodes per run. A run stays in the target's
# steps (a token every step, never waited for) and reserves its growth up front: the
# KV budget sees at most this many tokens ahead; between runs the session is let go.
DECODE_RUN_TOKENS = 64


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(
        self,
        sessions: SessionCache,
        worker_id: str,
        model_info: common_pb2.ModelInfo,
        default_max_new_tokens: int,
        worker_address: str = "",  # set once the server has bound its port
        admission: Admission | None = None,
    ):
        self.sessions = sessions
        self.admission = admission or Admission(max_running=sessions.max_sessions, max_queued=0)
        self.worker_id = worker_id
        self.worker_address = worker_address
        self.model_info = model_info
        self.default_max_new_tokens = default_max_new_tokens
        telemetry.current().register_load_gauges(self._load, {"specdec.worker.id": worker_id})

    @rpc_errors
    def OpenSession(self, request, context):
        params = self._sampling(request.sampling)
        session_id = request.session_id or uuid.uuid4().hex
        prompt_token_ids = list(request.prompt_token_ids)
        with (self._admitted(context) as waited_ns,
              _prefill_span(session_id, 0, len(prompt_token_ids)) as span):
            prefill_ns, _ = self.sessions.open(session_id, prompt_token_ids, params)
            span.set_attributes({"specdec.prefill_ns": prefill_ns, "specdec.admission_wait_ns": waited_ns})
        log.debug("opened session", extra={"fields": {"session_id": session_id, "prompt_len": len(prompt_token_ids)}})
        handle = common_pb2.KvHandle(
            worker_id=self.worker_id, worker_address=self.worker_address,
            session_id=session_id, committed_len=len(prompt_token_ids),
        )
        return target_pb2.OpenSessionResponse(handle=handle, prefill_ns=prefill_ns)

    @rpc_errors
    def Extend(self, request, context):
        with (self._admitted(context) as waited_ns,
              self.sessions.use(request.session_id, growth=len(request.token_ids)) as target,
              _prefill_span(request.session_id, request.base_len, len(request.token_ids)) as span):
            if not request.token_ids:  # as on the draft worker: nothing to extend is a mistake
                raise InvalidArgument("no token ids given: send at least one")
            start = time.perf_counter_ns()
            self.sessions.compute.submit(target.extend_steps(request.base_len, list(request.token_ids)))
            prefill_ns = time.perf_counter_ns() - start
            span.set_attributes({"specdec.prefill_ns": prefill_ns, "specdec.admission_wait_ns": waited_ns})
            return common_pb2.ExtendResponse(committed_len=target.length, prefill_ns=prefill_ns)

    @rpc_errors
    def Verify(self, request_iterator, context):
        with contextlib.ExitStack() as admitted:
            for index, proposal in enumerate(request_iterator):
                # The stream takes its running slot with its first proposal.
                waited_ns = admitted.enter_context(self._admitted(context)) if index == 0 else 0
                if proposal.HasField("stretch"):
                    yield from self._stretch(proposal, waited_ns, context)
                    continue
                with tracer.start_as_current_span(telemetry.VERIFY_SPAN) as span:
                    verdict = self._verify(proposal, waited_ns)
                    if span.is_recording():
                        span.set_attributes(_verify_attributes(proposal, verdict))
                yield verdict

    @rpc_errors
    def Decode(self, request, context):
        length, max_new_tokens = self._start_decode(request)
        timing = _DecodeTiming()
        with self._admitted(context) as waited_ns:
            try:
                for result, _, _, step in self._decode_tokens(request.session_id, length, max_new_tokens, None,
                                                              None, waited_ns, timing, context):
                    yield target_pb2.DecodeToken(
                        token_id=result.token_ids[0], committed_len=result.committed_len,
                        compute_ns=result.target_compute_ns, step=step,
                    )
            finally:
                timing.record()

    @rpc_errors
    def Truncate(self, request, context):
        with self.sessions.use(request.session_id) as target:
            if not 1 <= request.length <= target.length:
                raise InvalidArgument(
                    f"truncate length must be in [1, {target.length}] (the session's committed "
                    f"length), got {request.length}"
                )
            target.truncate_to(request.length)
            return common_pb2.TruncateResponse(committed_len=target.length)

    @rpc_errors
    def CloseSession(self, request, context):
        # Idempotent (common.proto): closing an unknown or evicted session is not an error.
        if not self.sessions.close(request.session_id):
            log.debug("close of unknown session", extra={"fields": {"session_id": request.session_id}})
        return common_pb2.CloseSessionResponse()

    @rpc_errors
    def Info(self, request, context):
        load = self._load()
        return common_pb2.InfoResponse(
            worker_id=self.worker_id,
            model=self.model_info,
            load=common_pb2.WorkerLoad(
                active_sessions=load.active_sessions, max_sessions=load.max_sessions,
                cached_tokens=load.cached_tokens, max_cached_tokens=load.max_cached_tokens,
                queued_calls=load.queued_calls, running_calls=load.running_calls, max_running=load.max_running,
                mean_batch_tokens=load.mean_batch_tokens, max_batch_tokens=load.max_batch_tokens,
            ),
        )

    @rpc_errors
    def GetTokenizer(self, request, context):
        return self._served_tokenizer

    @functools.cached_property
    def _served_tokenizer(self) -> target_pb2.GetTokenizerResponse:
        return served_tokenizer(self.sessions.loaded)

    def _load(self) -> telemetry.WorkerLoad:
        load = self.sessions.load()
        admission = self.admission.load()
        return telemetry.WorkerLoad(
            active_sessions=load.active_sessions, max_sessions=self.sessions.max_sessions,
            cached_tokens=load.cached_tokens, max_cached_tokens=self.sessions.max_cached_tokens,
            running_calls=admission.running, queued_calls=admission.queued,
            max_running=self.admission.max_running,
            mean_batch_tokens=self.sessions.compute.occupancy(),
            max_batch_tokens=self.sessions.compute.max_batch_tokens,
        )

    @contextlib.contextmanager
    def _admitted(self, context) -> Iterator[int]:
        """A running slot for the call (see Admission); yields how long it waited for
        it, in nanoseconds."""
        waited_ns = self.admission.acquire(time_remaining(context))
        try:
            yield waited_ns
        finally:
            self.admission.release()

    # Verify: one proposal -> one verdict.

    def _verify(self, proposal: target_pb2.Proposal, waited_ns: int = 0) -> target_pb2.Verdict:
        # 1. Parse and validate what needs no session.
        sampling = self._sampling(proposal.sampling) if proposal.HasField("sampling") else None
        draft_probs = [sparse_from_proto(d) for d in proposal.draft_distributions] or None
        draft_token_ids = list(proposal.draft_token_ids)
        with self.sessions.use(proposal.session_id, growth=len(draft_token_ids) + 1) as target:
            # 2. A stale or duplicated proposal is answered in-band, nothing applied.
            if _is_stale(target, proposal):
                log.debug("discarded proposal", extra={"fields": {
                    "session_id": proposal.session_id, "round": proposal.round,
                    "base_len": proposal.base_len, "committed_len": target.length,
                }})
                return _echo(proposal, discarded=True, committed_len=target.length)
            # 3. One forward pass (batched with other sessions'), the acceptance rule and
            #    the rollback, in the core.
            with _sampling_applied(target, sampling):
                result, load = self.sessions.compute.submit(
                    target.verify_steps(proposal.base_len, draft_token_ids, draft_probs), key=proposal.session_id)
            verdict = _verdict(proposal, result, target.context_length)
            verdict.step.CopyFrom(_step_proto(load, waited_ns))
            return verdict

    # A stretch: the target decodes on the Verify stream, one verdict per pass.

    def _stretch(self, proposal: target_pb2.Proposal, waited_ns: int, context) -> Iterator[target_pb2.Verdict]:
        start = self._start_stretch(proposal)
        if start.stale_at is not None:
            yield _echo(proposal, discarded=True, committed_len=start.stale_at, stretch_ended=True)
            return
        length, timing = proposal.base_len, _DecodeTiming()
        try:
            tokens = self._decode_tokens(proposal.session_id, length, proposal.stretch.max_tokens, start.until,
                                         start.lookup, waited_ns, timing, context, proposal.round)
            for result, accepted, ends, step in tokens:
                verdict = _verdict(proposal, result, start.context_length, base_len=length)
                verdict.step.CopyFrom(step)
                verdict.stretch_ended = ends or result.committed_len - proposal.base_len >= proposal.stretch.max_tokens
                verdict.num_drafted = result.num_drafted
                verdict.accepted_token_ids.extend(accepted)
                length = result.committed_len
                yield verdict
        finally:
            timing.record()

    def _start_stretch(self, proposal: target_pb2.Proposal) -> _StretchStart:
        """Checks the stretch and applies the proposal's sampling, unless the proposal
        does not match the session."""
        stretch = proposal.stretch
        if proposal.draft_token_ids or proposal.draft_distributions:
            raise InvalidArgument("a stretch proposal has no draft tokens: send them in a proposal without stretch")
        if stretch.max_tokens < 1:
            raise InvalidArgument(f"stretch.max_tokens must be >= 1, got {stretch.max_tokens}")
        if stretch.HasField("until_lookup") and stretch.HasField("lookup_rounds"):
            raise InvalidArgument("a stretch either ends at text to copy (until_lookup) or verifies it "
                                  "(lookup_rounds), not both")
        until = lookup_stop_from_proto(stretch.until_lookup) if stretch.HasField("until_lookup") else None
        lookup = lookup_rounds_from_proto(stretch.lookup_rounds) if stretch.HasField("lookup_rounds") else None
        sampling = self._sampling(proposal.sampling) if proposal.HasField("sampling") else None
        with self.sessions.use(proposal.session_id) as target:
            if _is_stale(target, proposal):
                return _StretchStart(None, None, target.context_length, stale_at=target.length)
            if sampling is not None:
                target.set_sampling(sampling)
            return _StretchStart(until, lookup, target.context_length)

    def _decode_tokens(self, session_id: str, length: int, max_tokens: int, until: LookupStop | None,
                       lookup: LookupRounds | None, waited_ns: int, timing: _DecodeTiming, context,
                       round_index: int | None = None,
                       ) -> Iterator[tuple[VerifyResult, list[int], bool, common_pb2.StepLoad]]:
        """Up to max_tokens tokens the target decodes from `length` (alone, or verifying
        prompt lookup with `lookup`), batched with other sessions' work: a pass at a
        time, with the looked-up tokens it accepted, whether decoding ends after it and
        its step, in a specdec.decode span each. Ends early where decoding ends (a stop
        token, a full context, text to copy with `until`) or the caller went away. Runs of DECODE_RUN_TOKENS: a run holds
        the session, which closing or evicting it stops within a step (the next run
        then finds it gone: NOT_FOUND)."""
        decoded, last_ns = 0, time.time_ns()
        extra = lookup.max_draft_tokens if lookup is not None else 0  # a pass's rejected tokens, cached until cut
        while decoded < max_tokens:
            size, stop, progressed = min(DECODE_RUN_TOKENS, max_tokens - decoded), threading.Event(), False
            with self.sessions.use(session_id, growth=size + extra, stop=stop) as target:
                run = _decode_run(target, length, size, until, lookup, stop)
                with contextlib.closing(self.sessions.compute.stream(run, key=session_id)) as tokens:
                    for (result, accepted, ends, emitted_ns), load in tokens:
                        step = _step_proto(load, waited_ns)
                        timing.add(emitted_ns - last_ns)
                        _decode_span(session_id, length, result, step, last_ns, emitted_ns, round_index)
                        yield result, accepted, ends, step
                        decoded, length, last_ns, waited_ns, progressed = \
                            decoded + len(result.token_ids), result.committed_len, emitted_ns, 0, True
                        if ends or not context.is_active():  # done, or the caller went away
                            return
            if not progressed and not stop.is_set():  # the context is full: nothing to decode
                return

    def _start_decode(self, request: target_pb2.DecodeRequest) -> tuple[int, int]:
        """Checks base_len, applies the call's sampling; returns (base_len, tokens to decode)."""
        sampling = self._sampling(request.sampling) if request.HasField("sampling") else None
        if request.max_tokens < 0:  # checked before the session is touched
            raise InvalidArgument(f"max_tokens must be >= 0 (0 = up to max_new_tokens), got {request.max_tokens}")
        with self.sessions.use(request.session_id) as target:
            if request.base_len != target.length:
                raise StaleProposal(
                    f"decode from length {request.base_len} but the session has {target.length} committed tokens"
                )
            if sampling is not None:
                target.set_sampling(sampling)
            max_new_tokens = target.params.max_new_tokens
            return target.length, min(max_new_tokens, request.max_tokens or max_new_tokens)

    def _sampling(self, message: common_pb2.SamplingParams) -> SamplingParams:
        return sampling_from_proto(message, self.default_max_new_tokens)


def _decode_run(target: TargetSession, base_len: int, max_tokens: int, until: LookupStop | None,
                lookup: LookupRounds | None, stop: threading.Event) -> ForwardSteps[None]:
    """Up to max_tokens tokens decoded by the target (alone, or verifying prompt lookup
    with `lookup`), each pass's result emitted as it is decided with the looked-up
    tokens it accepted, whether decoding ends after it and when (wall clock, ns); on
    the compute thread, as lookup scans the sequence. Ends early once `stop` is set."""
    length, left = base_len, max_tokens
    while left > 0:
        if stop.is_set() or length >= target.context_length:
            return
        proposal = target.lookup_proposal(left, lookup)
        result = yield from target.verify_steps(length, proposal)
        ends = target.decoding_ends(result, until)
        yield Emit((result, proposal[: result.verdict.num_accepted], ends, time.time_ns()))
        if ends:
            return
        length, left = result.committed_len, left - len(result.token_ids)


def _decode_span(session_id: str, base_len: int, result: VerifyResult, step: common_pb2.StepLoad,
                 start_ns: int, end_ns: int, round_index: int | None) -> None:
    """A specdec.decode span for one pass of decoding (a token alone, or verifying prompt
    lookup's tokens too), from the previous pass's time (the run's start for the
    first) to its own."""
    span = tracer.start_span(telemetry.DECODE_SPAN, start_time=start_ns)
    if span.is_recording():
        attributes = {"specdec.session_id": session_id, "specdec.base_len": base_len,
                      "specdec.target_compute_ns": result.target_compute_ns, **_step_attributes(step)}
        if result.num_drafted:  # a pass that verified prompt lookup's tokens (Stretch.lookup_rounds)
            attributes.update({"specdec.k": result.num_drafted, "specdec.accepted": result.verdict.num_accepted})
        if round_index is not None:
            attributes["specdec.round"] = round_index
        span.set_attributes(attributes)
    span.end(end_time=end_ns)


def _step_proto(load: StepLoad | None, admission_wait_ns: int = 0) -> common_pb2.StepLoad:
    """The step a call's work ran in; the call's wait for admission counts as queueing."""
    if load is None:
        return common_pb2.StepLoad(queue_ns=admission_wait_ns)
    return common_pb2.StepLoad(
        queue_ns=load.queue_ns + admission_wait_ns, step_ns=load.step_ns, batch_tokens=load.batch_tokens,
        batch_sessions=load.batch_sessions, waiting_sessions=load.waiting_sessions,
        cost_base_ns=load.cost_base_ns, cost_per_token_ns=load.cost_per_token_ns,
    )


def _step_attributes(step: common_pb2.StepLoad) -> dict:
    """Span attributes of the step that ran a call's work."""
    return {
        "specdec.queue_ns": step.queue_ns, "specdec.step_ns": step.step_ns,
        "specdec.batch_tokens": step.batch_tokens, "specdec.batch_sessions": step.batch_sessions,
    }


def _prefill_span(session_id: str, base_len: int, num_tokens: int):
    """A specdec.prefill span around new input entering a target session."""
    return tracer.start_as_current_span(telemetry.PREFILL_SPAN, attributes={
        "specdec.session_id": session_id, "specdec.base_len": base_len, "specdec.tokens": num_tokens,
    })


def _verify_attributes(proposal: target_pb2.Proposal, verdict: target_pb2.Verdict) -> dict:
    """Attributes of a specdec.verify span: the proposal and what the target decided."""
    return {
        "specdec.session_id": proposal.session_id,
        "specdec.round": proposal.round,
        "specdec.base_len": proposal.base_len,
        "specdec.k": len(proposal.draft_token_ids),
        "specdec.discarded": verdict.discarded,
        "specdec.accepted": verdict.num_accepted,
        "specdec.committed": max(0, verdict.committed_len - proposal.base_len) if not verdict.discarded else 0,
        "specdec.target_compute_ns": verdict.target_compute_ns,
        **_step_attributes(verdict.step),
    }


@dataclass(frozen=True)
class _StretchStart:
    """A stretch checked against its session."""

    until: LookupStop | None  # where text to copy ends it (None: nowhere)
    lookup: LookupRounds | None  # the lookup its passes verify (None: none)
    context_length: int
    stale_at: int | None = None  # the session's committed length, where the proposal does not match it


class _DecodeTiming:
    """Time per output token of one Decode stream (target-only decoding)."""

    def __init__(self):
        self.total_ns = 0  # session lock and forward passes, in nanoseconds
        self.num_tokens = 0

    def add(self, elapsed_ns: int) -> None:
        self.total_ns += elapsed_ns
        self.num_tokens += 1

    def record(self) -> None:
        if self.num_tokens:
            telemetry.instruments().time_per_output_token.record(self.total_ns * 1e-9 / self.num_tokens)


def _is_stale(target: TargetSession, proposal: target_pb2.Proposal) -> bool:
    if proposal.base_len != target.length:
        return True
    if not proposal.HasField("expected_last_token_id"):
        return False
    return target.last_token_id != proposal.expected_last_token_id


@contextlib.contextmanager
def _sampling_applied(target: TargetSession, sampling: SamplingParams | None) -> Iterator[None]:
    """Sets the proposal's sampling; restores the previous params if the proposal fails,
    so a refused proposal changes nothing."""
    if sampling is None:
        yield
        return
    previous = (target.params, target.generator)
    target.set_sampling(sampling)
    try:
        yield
    except BaseException:
        target.params, target.generator = previous
        raise


def _echo(proposal: target_pb2.Proposal, **fields) -> target_pb2.Verdict:
    """A verdict echoing the proposal's identity."""
    return target_pb2.Verdict(
        session_id=proposal.session_id, round=proposal.round, base_len=proposal.base_len, **fields
    )


def _verdict(proposal: target_pb2.Proposal, result: VerifyResult, context_length: int,
             base_len: int | None = None) -> target_pb2.Verdict:
    """The verdict on a proposal; base_len: the length before a stretch's token."""
    if result.stopped:
        finish_reason = common_pb2.FINISH_REASON_STOP_TOKEN
    elif result.committed_len >= context_length:  # not even a k = 0 proposal fits
        finish_reason = common_pb2.FINISH_REASON_LENGTH
    else:
        finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
    verdict = _echo(
        proposal,
        num_accepted=result.verdict.num_accepted,
        next_token_id=result.verdict.next_token_id,
        next_token_kind=NEXT_TOKEN_KIND_TO_PROTO[result.verdict.next_token_kind],
        committed_len=result.committed_len,
        target_compute_ns=result.target_compute_ns,
        finished=finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED,
        finish_reason=finish_reason,
    )
    if base_len is not None:
        verdict.base_len = base_len
    return verdict


def served_tokenizer(loaded: LoadedModel) -> target_pb2.GetTokenizerResponse:
    """The model's tokenizer as GetTokenizer serves it (orchestrator/tokenizer.py rebuilds it)."""
    tokenizer = loaded.tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise FailedPrecondition(
            f"model {loaded.name!r} has no tokenizer of the tokenizers library to serve: "
            "start the orchestrator with --tokenizer")
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: the one transformers uses by default
        template = template.get("default")
    return target_pb2.GetTokenizerResponse(
        # mtime=0: the same tokenizer gives the same bytes on every worker.
        tokenizer_json_gzip=gzip.compress(backend.to_str().encode(), compresslevel=6, mtime=0),
        chat_template=template or "",
        special_tokens={name: str(token) for name, token in tokenizer.special_tokens_map.items()},
        clean_up_tokenization_spaces=_cleans_up_spaces(tokenizer, backend),
        fingerprint=loaded.fingerprint,
        model_id=loaded.name,
    )


def _cleans_up_spaces(tokenizer, backend) -> bool:
    """Whether transformers' decode removes spaces before punctuation for this tokenizer:
    its setting, which transformers ignores for BPE models unless told it really means it."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return type(backend.model).__name__ != "BPE" or bool(forced)
