"""OpenTelemetry for the three services: traces, metrics, the Prometheus endpoint.

    telemetry.setup("target", config)          # once, in main(), before building the server
    telemetry.current().server_interceptors()  # -> service_common.server.create_server
    telemetry.current().intercept_channel(ch)  # every client channel (service_common.server.channel)
    telemetry.instruments().rounds.add(1)      # the metric instruments, defined once, below

`config` has the fields of `service_common.options.TelemetryConfig`. With
`trace_exporter="none"` and `metrics_port=0` (the default) nothing is installed: no
provider, no interceptor, and the spans and instruments the code creates are the
OpenTelemetry API's no-op ones (a few hundred nanoseconds per round of tens of ms).

Tracing: a TracerProvider whose Resource names the role (`service.name`), with the
exporter the configuration picks: OTLP over gRPC, JSON lines to a file (one span per
line, `JsonLinesSpanExporter`; `python -m report` reads it) or the console. gRPC calls
are traced by the explicit interceptors of opentelemetry-instrumentation-grpc
(`server_interceptor()`, `client_interceptor()`), health checks, reflection and the
`Info` polls filtered out; the trace context travels in the gRPC metadata (W3C
traceparent), so a request is one trace across orchestrator -> draft -> target.

One exception: the library's client interceptor turns a server-streaming call into a
plain generator, which cannot be cancelled (opentelemetry-python-contrib issue #2014),
and the orchestrator cancels its Speculate and Decode streams. Those calls go through
`_ServerStreamTracer` instead, a standard grpc interceptor that starts the same CLIENT
span, injects it into the metadata and ends it when the call is done, returning the
call object unchanged.

Metrics: the OpenTelemetry metrics API; a MeterProvider with a PrometheusMetricReader,
served by prometheus_client on `metrics_port` (0 = no endpoint), and pushed over OTLP
when the OTLP exporter is chosen. The load gauges (`register_load_gauges`) are read by
the Kubernetes HPAs: `specdec_worker_sessions_active` (both pools),
`specdec_worker_calls_utilization` (the target pool: running plus queued calls per
running slot, so the pool grows when its calls queue) and
`specdec_worker_draft_verify_time_ratio` (the draft pool: drafting over verifying time of
the recent rounds, so the pool grows when drafting holds its rounds up); deploy/README.md
explains each.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import prometheus_client
from opentelemetry import metrics, propagate, trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.instrumentation.grpc import client_interceptor, server_interceptor
from opentelemetry.instrumentation.grpc.grpcext import intercept_channel as intercept_with_library
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import SpanKind, Status, StatusCode

from foundation.errors import InvalidArgument
from speculative.stats import RoundStats

log = logging.getLogger(__name__)

EXPORTERS = ("none", "otlp", "jsonl", "console")
METER_NAME = "specdec"

# Span names and attributes written by the workers (and read by `python -m report`).
ROUND_SPAN = "specdec.round"  # draft worker: one per speculation round
VERIFY_SPAN = "specdec.verify"  # target worker: one per proposal on a Verify stream
DECODE_SPAN = "specdec.decode"  # target worker: one per pass of a Decode stream or a stretch
PREFILL_SPAN = "specdec.prefill"  # both workers: OpenSession / Extend

# Prometheus names the Kubernetes HPA reads: do not change them.
SESSIONS_ACTIVE_GAUGE = "specdec.worker.sessions.active"  # -> specdec_worker_sessions_active
LOAD_GAUGE = "specdec.worker.load"  # -> specdec_worker_load
CACHED_TOKENS_GAUGE = "specdec.worker.cached_tokens"  # -> specdec_worker_cached_tokens
# Admission and batching: exported only by workers that have admission (the target).
CALLS_UTILIZATION_GAUGE = (
    "specdec.worker.calls.utilization"  # -> specdec_worker_calls_utilization (HPA)
)
CALLS_RUNNING_GAUGE = "specdec.worker.calls.running"  # -> specdec_worker_calls_running
CALLS_QUEUED_GAUGE = "specdec.worker.calls.queued"  # -> specdec_worker_calls_queued
MAX_RUNNING_GAUGE = "specdec.worker.calls.max_running"  # -> specdec_worker_calls_max_running
BATCH_MEAN_TOKENS_GAUGE = "specdec.worker.batch.mean_tokens"  # -> specdec_worker_batch_mean_tokens
BATCH_MAX_TOKENS_GAUGE = "specdec.worker.batch.max_tokens"  # -> specdec_worker_batch_max_tokens
# Speculation: exported only by workers that draft (the draft pool's HPA).
DRAFT_VERIFY_TIME_RATIO_GAUGE = (
    "specdec.worker.draft_verify_time_ratio"  # -> specdec_worker_draft_verify_time_ratio (HPA)
)

# The workers' load gauges: (name, value of a WorkerLoad, only for workers that admit
# calls (a target), unit, description). A value of None is not observed: the gauge does
# not apply to that worker.
LOAD_GAUGES = [
    (
        SESSIONS_ACTIVE_GAUGE,
        lambda load: load.active_sessions,
        False,
        "{session}",
        "Sessions whose KV cache the worker holds",
    ),
    (
        LOAD_GAUGE,
        lambda load: load.fraction,
        False,
        "{fraction}",
        "Fraction of the worker's capacity in use (sessions or cached tokens, the fuller), 0..1",
    ),
    (
        CACHED_TOKENS_GAUGE,
        lambda load: load.cached_tokens,
        False,
        "{token}",
        "Tokens held in the worker's KV caches",
    ),
    (
        CALLS_UTILIZATION_GAUGE,
        lambda load: load.calls_utilization,
        True,
        "{fraction}",
        "Running plus queued calls per running slot (max_running): above 1 while calls queue",
    ),
    (
        CALLS_RUNNING_GAUGE,
        lambda load: load.running_calls,
        True,
        "{call}",
        "Calls holding a running slot (doing model work in the batched steps)",
    ),
    (
        CALLS_QUEUED_GAUGE,
        lambda load: load.queued_calls,
        True,
        "{call}",
        "Calls waiting for a running slot",
    ),
    (
        MAX_RUNNING_GAUGE,
        lambda load: load.max_running,
        True,
        "{call}",
        "Running slots: calls that may do model work at once (max_running)",
    ),
    (
        BATCH_MEAN_TOKENS_GAUGE,
        lambda load: load.mean_batch_tokens,
        True,
        "{token}",
        "Tokens per batched forward pass, mean of the recent steps",
    ),
    (
        BATCH_MAX_TOKENS_GAUGE,
        lambda load: load.max_batch_tokens,
        True,
        "{token}",
        "Token budget of one batched forward pass (max_batch_tokens)",
    ),
    (
        DRAFT_VERIFY_TIME_RATIO_GAUGE,
        lambda load: load.draft_verify_time_ratio,
        False,
        "1",
        "Drafting time over the target's verifying time of the worker's rounds in the last "
        "30 s (0: no round); near 1 the draft side is the rounds' bottleneck",
    ),
]

# Round phases are milliseconds to a second; tokens 10 ms to seconds on CPU.
_ROUND_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
# The bucket boundaries gen_ai.server.time_per_output_token is specified with.
_TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


# --- instruments ------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruments:
    """Every metric instrument of the system. Attributes are noted per instrument; the
    totals of the per-position counters are their sums over `position`."""

    drafts: (
        metrics.Counter
    )  # rounds (or stretch passes verifying prompt lookup) that drafted k > 0 tokens
    drafted_tokens: metrics.Counter  # draft tokens proposed; attribute position (0-based)
    accepted_tokens: metrics.Counter  # draft tokens accepted; attribute position (0-based)
    rounds: metrics.Counter  # rounds of a speculation loop: a proposal (k >= 0), one target pass
    stretch_tokens: metrics.Counter  # tokens adaptive calls had the target decode alone (stretches)
    fallbacks: metrics.Counter  # generations decoded target-only because no draft was usable
    failovers: metrics.Counter  # sessions moved to another worker; attribute pool (target | draft)
    # seconds; attribute phase (draft | verify_compute | network: speculative.stats.network_ns)
    round_duration: metrics.Histogram
    time_per_output_token: metrics.Histogram  # seconds, per call: `OutputTiming`

    def record_round(self, stats: RoundStats) -> None:
        """Counts one finished round, or one pass of a stretch (the draft worker calls
        this for each): its own token, and the prompt-lookup tokens it verified."""
        if stats.num_drafted > 0:
            self.drafts.add(1)
        for position in range(stats.num_drafted):
            self.drafted_tokens.add(1, {"position": position})
        for position in range(stats.num_accepted):
            self.accepted_tokens.add(1, {"position": position})
        if stats.streamed:
            self.stretch_tokens.add(1)
            return
        self.rounds.add(1)
        for phase, ns in (
            ("draft", stats.draft_ns),
            ("verify_compute", stats.target_compute_ns),
            ("network", stats.network_ns),
        ):
            self.round_duration.record(ns * 1e-9, {"phase": phase})


@dataclass
class OutputTiming:
    """When one call's output tokens came out, for its time per output token (TPOT,
    docs/glossary.md): from its first output token to its last, over the tokens after
    the first, i.e. (end-to-end latency - time to first token) / (output tokens - 1), as
    vLLM and the OpenTelemetry GenAI conventions define it; none for a call of one token.
    Every service records its calls' into gen_ai.server.time_per_output_token. Times in
    nanoseconds, on any one clock."""

    first_ns: int | None = None  # when the first output token came out (None: none yet)
    last_ns: int = 0  # when the last one came out
    num_tokens: int = 0

    def add(self, num_tokens: int, at_ns: int) -> None:
        """num_tokens output tokens came out at at_ns (a round's or a pass's, at once)."""
        if not num_tokens:
            return
        if self.first_ns is None:
            self.first_ns = at_ns
        self.last_ns = at_ns
        self.num_tokens += num_tokens

    @property
    def time_per_output_token_ns(self) -> float | None:
        if self.first_ns is None or self.num_tokens < 2:
            return None
        return (self.last_ns - self.first_ns) / (self.num_tokens - 1)

    def record(self) -> None:
        """Into the metric, in seconds, where the call had one."""
        if (tpot_ns := self.time_per_output_token_ns) is not None:
            instruments().time_per_output_token.record(tpot_ns * 1e-9)


_instruments_lock = threading.Lock()
_instruments: tuple[object, Instruments] | None = None  # (meter provider, its instruments)


def instruments() -> Instruments:
    """The instruments of the process's meter provider: no-ops until `setup` installs one
    (the API's proxies, which cost next to nothing)."""
    global _instruments
    provider = metrics.get_meter_provider()
    with _instruments_lock:
        if _instruments is None or _instruments[0] is not provider:
            _instruments = (provider, _create_instruments(provider.get_meter(METER_NAME)))
        return _instruments[1]


def _create_instruments(meter: metrics.Meter) -> Instruments:
    return Instruments(
        drafts=meter.create_counter(
            "specdec.drafts", "{draft}", "Speculation rounds that drafted at least one token"
        ),
        drafted_tokens=meter.create_counter(
            "specdec.draft.tokens",
            "{token}",
            "Draft tokens proposed, by draft position (attribute position)",
        ),
        accepted_tokens=meter.create_counter(
            "specdec.accepted.tokens",
            "{token}",
            "Draft tokens accepted, by draft position (attribute position)",
        ),
        rounds=meter.create_counter(
            "specdec.rounds",
            "{round}",
            "Speculation rounds: one proposal (k >= 0) verified in one target pass",
        ),
        stretch_tokens=meter.create_counter(
            "specdec.stretch.tokens",
            "{token}",
            "Tokens adaptive calls had the target decode alone (speculation did not pay)",
        ),
        fallbacks=meter.create_counter(
            "specdec.fallbacks",
            "{generation}",
            "Generations decoded by the target alone because no draft was usable",
        ),
        failovers=meter.create_counter(
            "specdec.failovers", "{failover}", "Sessions moved to another worker (attribute pool)"
        ),
        round_duration=meter.create_histogram(
            "specdec.round.duration",
            "s",
            "Time of a speculation round by phase: draft, verify_compute, network (the round "
            "trip less the target's pass)",
            explicit_bucket_boundaries_advisory=_ROUND_BUCKETS_S,
        ),
        time_per_output_token=meter.create_histogram(
            "gen_ai.server.time_per_output_token",
            "s",
            "Time per output token after the first, per call: (last token - first) / (tokens - 1)",
            explicit_bucket_boundaries_advisory=_TPOT_BUCKETS_S,
        ),
    )


# --- load gauges ------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerLoad:
    """What a worker holds against its capacity, and how its work goes. The admission
    and batch fields are the target's (target_service.admission, the step scheduler); a
    worker without admission (the draft) leaves max_running at 0 and exports no call or
    batch gauges. The draft-to-verify time ratio is the draft's."""

    active_sessions: int
    max_sessions: int
    cached_tokens: int  # tokens held in KV caches (or n-gram histories)
    max_cached_tokens: int  # tokens
    running_calls: int = 0  # calls holding a running slot (doing model work)
    queued_calls: int = 0  # calls waiting for a running slot
    max_running: int = 0  # running slots; 0 = the worker has no admission control
    mean_batch_tokens: float = 0.0  # tokens per batched forward pass, mean of the recent steps
    max_batch_tokens: int = 0  # the step's token budget
    # Drafting over verifying time of the recent rounds (draft_service.round_times);
    # None: the worker does not draft (a target) and exports no such gauge.
    draft_verify_time_ratio: float | None = None

    @property
    def fraction(self) -> float:
        """Fraction of capacity in use, 0..1: the fuller of the two budgets."""
        sessions = self.active_sessions / self.max_sessions if self.max_sessions else 0.0
        tokens = self.cached_tokens / self.max_cached_tokens if self.max_cached_tokens else 0.0
        return min(1.0, max(sessions, tokens))

    @property
    def has_admission(self) -> bool:
        return self.max_running > 0

    @property
    def calls_utilization(self) -> float:
        """(running + queued) calls per running slot: up to 1 while every call runs,
        above 1 while calls queue (refusals start past 1 + max_queued / max_running).
        Not capped, so an HPA averaging it sees how far its pool is behind."""
        return (
            (self.running_calls + self.queued_calls) / self.max_running if self.max_running else 0.0
        )


LoadCallback = Callable[[], WorkerLoad]


def _if_admitted(value: Callable[[WorkerLoad], float]) -> Callable[[WorkerLoad], float | None]:
    """A call or batch gauge's value: None (not observed) for a worker without admission."""
    return lambda load: value(load) if load.has_admission else None


# --- the process's telemetry ------------------------------------------------------------


class Telemetry:
    """What `setup` installed for one process. The default instance installs nothing."""

    def __init__(
        self, role: str = "", tracer_provider=None, meter_provider=None, metrics_server=None
    ):
        self.role = role
        self.tracer_provider = tracer_provider  # None = tracing off
        self.meter_provider = meter_provider  # None = metrics off
        self.metrics_server = metrics_server  # prometheus_client's HTTP server, if any
        self._load_callbacks: list[tuple[LoadCallback, dict]] = []
        self._lock = threading.Lock()
        self._shut_down = False
        if meter_provider is not None:
            self._create_gauges(meter_provider.get_meter(METER_NAME))
        if tracer_provider is not None or meter_provider is not None:
            atexit.register(self.shutdown)  # spans still buffered are not lost at exit

    @property
    def tracing(self) -> bool:
        return self.tracer_provider is not None

    @property
    def metrics_port(self) -> int:
        """The bound port of the /metrics endpoint; 0 when there is none."""
        return self.metrics_server.server_port if self.metrics_server is not None else 0

    def server_interceptors(self) -> list[grpc.ServerInterceptor]:
        """For service_common.server.create_server(..., interceptors=...)."""
        if not self.tracing:
            return []
        return [server_interceptor(tracer_provider=self.tracer_provider, filter_=_traced)]

    def intercept_channel(self, channel: grpc.Channel) -> grpc.Channel:
        """A client channel whose calls carry the trace context (unchanged when off)."""
        if not self.tracing:
            return channel
        tracer = self.tracer_provider.get_tracer(__name__)
        streaming = grpc.intercept_channel(channel, _ServerStreamTracer(tracer))
        library = client_interceptor(
            tracer_provider=self.tracer_provider, filter_=_traced_by_library
        )
        return intercept_with_library(streaming, library)

    def register_load_gauges(self, callback: LoadCallback, attributes: dict | None = None) -> None:
        """Observes `callback()` at each collection into the load gauges: sessions,
        load and cached tokens always; calls and batch gauges when the load has
        admission (max_running > 0); the draft-to-verify time ratio when it has one (a
        draft). Several workers in one process: give each its own attributes."""
        with self._lock:
            self._load_callbacks.append((callback, dict(attributes or {})))

    def shutdown(self) -> None:
        """Flushes and stops exporters and the /metrics endpoint. Idempotent."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
            self.metrics_server = None

    def _create_gauges(self, meter: metrics.Meter) -> None:
        for name, value, admitted_only, unit, description in LOAD_GAUGES:
            observed = _if_admitted(value) if admitted_only else value
            meter.create_observable_gauge(name, [self._observe(observed)], unit, description)

    def _observe(self, value: Callable[[WorkerLoad], float | None]):
        """A gauge callback: one observation per registered worker; a value of None
        (a gauge that does not apply to the worker) is left out."""

        def callback(_options):
            with self._lock:
                callbacks = list(self._load_callbacks)
            observations = []
            for load_of, attributes in callbacks:
                try:
                    observed = value(load_of())
                    if observed is not None:
                        observations.append(metrics.Observation(observed, attributes))
                except Exception:  # a gauge must never break a scrape
                    log.exception("load callback failed")
            return observations

        return callback


_current = Telemetry()


def current() -> Telemetry:
    """The process's telemetry (a disabled one until `setup`)."""
    return _current


def setup(role: str, config, instance_id: str = "") -> Telemetry:
    """Installs tracing and metrics for a process as `config` says; call once per
    process, before building servers and channels. InvalidArgument on a bad setting."""
    global _current
    exporter = (config.trace_exporter or "none").lower()
    if exporter not in EXPORTERS:
        raise InvalidArgument(
            f"trace_exporter must be one of {list(EXPORTERS)}, got {config.trace_exporter!r}"
        )
    if exporter == "jsonl" and not config.trace_file:
        raise InvalidArgument("trace_exporter jsonl needs trace_file: the path of the span file")
    if config.metrics_port < 0:
        raise InvalidArgument(f"metrics_port must be >= 0 (0 = off), got {config.metrics_port}")
    if exporter == "none" and config.metrics_port == 0:
        _current = Telemetry(role)
        return _current
    resource = Resource.create(
        {
            "service.name": role,
            "service.instance.id": instance_id or f"{role}-{socket.gethostname()}-{os.getpid()}",
        }
    )
    tracer_provider = _tracer_provider(resource, exporter, config) if exporter != "none" else None
    meter_provider, metrics_server = _meter_provider(resource, exporter, config)
    _current = Telemetry(role, tracer_provider, meter_provider, metrics_server)
    log.info(
        "telemetry",
        extra={
            "fields": {
                "trace_exporter": exporter,
                "trace_file": config.trace_file or None,
                "metrics_port": _current.metrics_port or None,
            }
        },
    )
    return _current


def _tracer_provider(resource, exporter: str, config) -> TracerProvider:
    provider = TracerProvider(
        resource=resource, shutdown_on_exit=False
    )  # Telemetry.shutdown flushes
    if exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=config.otlp_endpoint or None))
        )
    elif exporter == "jsonl":
        provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(config.trace_file)))
    else:  # console: for a person watching, so at once
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider


def _meter_provider(resource, exporter: str, config):
    readers, metrics_server = [], None
    if config.metrics_port > 0:
        readers.append(PrometheusMetricReader())
        metrics_server, _thread = prometheus_client.start_http_server(config.metrics_port)
    if exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers.append(
            PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=config.otlp_endpoint or None))
        )
    if not readers:
        return None, None
    provider = MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False)
    metrics.set_meter_provider(provider)
    return provider, metrics_server


# --- which calls are traced -------------------------------------------------------------

_UNTRACED_SERVICE_PREFIXES = ("grpc.health.v1.", "grpc.reflection.")
# Info is polled every second by each orchestrator replica (worker load): a trace per
# poll would bury the requests.
_UNTRACED_METHODS = ("Info",)


def _method_of(details) -> str:
    method = getattr(details, "method", None) or getattr(details, "full_method", "") or ""
    return method.decode() if isinstance(method, bytes) else method


def _traced(details) -> bool:
    service, _, method = _method_of(details).lstrip("/").rpartition("/")
    return not service.startswith(_UNTRACED_SERVICE_PREFIXES) and method not in _UNTRACED_METHODS


def _traced_by_library(client_info) -> bool:
    """Client calls the library's interceptor handles: all traced ones but the
    server-streaming calls (see _ServerStreamTracer)."""
    server_streaming = (
        getattr(client_info, "is_server_stream", False) and not client_info.is_client_stream
    )
    return not server_streaming and _traced(client_info)


class _ServerStreamTracer(grpc.UnaryStreamClientInterceptor):
    """A CLIENT span around a server-streaming call, its context in the metadata; the
    call object (cancel(), iteration) is returned as grpc made it."""

    def __init__(self, tracer: trace.Tracer):
        self._tracer = tracer

    def intercept_unary_stream(self, continuation, client_call_details, request):
        if not _traced(client_call_details):
            return continuation(client_call_details, request)
        full_method = _method_of(client_call_details)
        service, _, method = full_method.lstrip("/").rpartition("/")
        span = self._tracer.start_span(
            full_method,
            kind=SpanKind.CLIENT,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": service,
                "rpc.method": method,
            },
        )
        metadata = list(client_call_details.metadata or [])
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        metadata.extend(carrier.items())
        details = _CallDetails(
            client_call_details.method,
            client_call_details.timeout,
            metadata,
            client_call_details.credentials,
            client_call_details.wait_for_ready,
            client_call_details.compression,
        )
        try:
            call = continuation(details, request)
        except BaseException:
            span.set_status(Status(StatusCode.ERROR))
            span.end()
            raise
        call.add_done_callback(lambda done: _end_call_span(span, done))
        return call


def _end_call_span(span: trace.Span, call) -> None:
    code = call.code()
    if code is not None:
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {call.details()}"))
    span.end()


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Sequence[tuple[str, str]] | None
    credentials: object
    wait_for_ready: bool | None
    compression: object


# --- the JSON-lines span file -----------------------------------------------------------


def span_to_dict(span) -> dict:
    """One finished SDK span as one JSON object: enough to rebuild the tree of a trace
    (trace_id, span_id, parent_span_id, all hex) across files and processes."""
    context = span.get_span_context()
    parent = span.parent
    resource = span.resource.attributes
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "start_ns": span.start_time,  # Unix time, nanoseconds
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": {key: _json_value(value) for key, value in (span.attributes or {}).items()},
        "resource": {
            key: resource[key] for key in ("service.name", "service.instance.id") if key in resource
        },
    }


def _json_value(value):
    return list(value) if isinstance(value, tuple) else value


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per span to a file. Each line is one write() to a file
    opened O_APPEND, so several processes may share the file without mixing lines."""

    def __init__(self, path: str):
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans):
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            for span in spans:
                line = json.dumps(span_to_dict(span), separators=(",", ":"), default=str) + "\n"
                os.write(self._fd, line.encode())
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
