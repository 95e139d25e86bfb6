"""service_common.telemetry: exporters, interceptors, context propagation, metrics.

OpenTelemetry's global providers can be set once per process, and module-level tracers
keep the first one, so this module sets up telemetry once (`traced`) and every test here
shares it; "none" is checked in a fresh interpreter.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import metrics, trace
from opentelemetry.util._once import Once

from draft_service import servicer as draft_servicer_module
from draft_service import speculation
from draft_service.config import DraftConfig
from draft_service.drafting import Drafters
from draft_service.servicer import DraftServicer
from draft_service.target_connections import TargetConnections
from foundation.errors import InvalidArgument
from service_common import server as common_server
from service_common import telemetry
from service_common.convert import model_info
from service_common.options import TelemetryConfig
from service_common.session_cache import SessionCache
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from speculative.rejection import NextTokenKind
from speculative.stats import RoundStats
from target_service import servicer as target_servicer_module
from target_service.admission import Admission
from target_service.servicer import TargetServicer
from target_service.sessions import TargetSessions
from tests.span_checks import check_round_times

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 20


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """Telemetry with the JSON-lines exporter and a /metrics endpoint, for this module."""
    trace_file = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    config = TelemetryConfig(
        trace_exporter="jsonl", trace_file=str(trace_file), metrics_port=_free_port()
    )
    installed = telemetry.setup("test", config)
    yield installed, trace_file
    installed.shutdown()
    # Leave the process as it was for the modules after this one.
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    metrics._internal._METER_PROVIDER_SET_ONCE = Once()
    metrics._internal._METER_PROVIDER = None
    telemetry._current = telemetry.Telemetry()
    # they cached the provider
    for module in (
        speculation,
        draft_servicer_module,
        target_servicer_module,
    ):
        module.tracer = trace.get_tracer(module.__name__)


def _spans(installed, trace_file: Path) -> list[dict]:
    installed.tracer_provider.force_flush()
    return [json.loads(line) for line in trace_file.read_text().splitlines()]


def _spans_with(installed, trace_file: Path, trace_id: str, name: str, kind: str) -> list[dict]:
    """The spans once trace_id holds a `kind` span called `name`. The draft's client
    span of its Verify stream ends when a thread of its own reads the target's end of
    the stream, which may come after the Speculate call has returned to the test."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        spans = _spans(installed, trace_file)
        if any(
            s["trace_id"] == trace_id and s["name"] == name and s["kind"] == kind for s in spans
        ):
            return spans
        assert time.monotonic() < deadline, f"no {kind} span {name} in trace {trace_id}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def workers(traced, tiny_target):
    """A target and a draft worker in process, both behind the tracing interceptors; the
    draft reaches the target through service_common.server.channel(), traced too."""
    installed, _ = traced
    target = TargetServicer(
        TargetSessions(tiny_target, 8, 100_000), "target-t", model_info(tiny_target, "cpu"), 64
    )
    target_server, target_port, _ = common_server.create_server(
        "127.0.0.1:0",
        lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(target, s),
        ["specdec.v1.TargetService"],
        interceptors=installed.server_interceptors(),
    )
    config = DraftConfig(address="127.0.0.1:0", worker_id="draft-t")
    draft = DraftServicer(
        config,
        Drafters(None, "ngram", 2, 4),
        SessionCache("draft", 8, 100_000, evicts_in_use=False),
        TargetConnections(),
    )
    draft_server, draft_port, _ = common_server.create_server(
        "127.0.0.1:0",
        lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(draft, s),
        ["specdec.v1.DraftService"],
        interceptors=installed.server_interceptors(),
    )
    target_server.start()
    draft_server.start()
    yield SimpleNamespace(
        target=f"127.0.0.1:{target_port}",
        draft=f"127.0.0.1:{draft_port}",
        target_servicer=target,
        draft_servicer=draft,
    )
    draft_server.stop(None)
    target_server.stop(None)


def _open_both(installed, workers, prompt: list[int], max_new_tokens: int):
    target_stub = target_pb2_grpc.TargetServiceStub(
        installed.intercept_channel(grpc.insecure_channel(workers.target))
    )
    draft_stub = draft_pb2_grpc.DraftServiceStub(
        installed.intercept_channel(grpc.insecure_channel(workers.draft))
    )
    sampling = common_pb2.SamplingParams(max_new_tokens=max_new_tokens)
    target_handle = target_stub.OpenSession(
        target_pb2.OpenSessionRequest(prompt_token_ids=prompt, sampling=sampling),
        timeout=DEADLINE_S,
    ).handle
    draft_handle = draft_stub.OpenSession(
        draft_pb2.DraftOpenSessionRequest(prompt_token_ids=prompt), timeout=DEADLINE_S
    ).handle
    request = draft_pb2.SpeculateRequest(
        session_id=draft_handle.session_id,
        base_len=len(prompt),
        target=common_pb2.KvHandle(
            worker_id=target_handle.worker_id,
            worker_address=workers.target,
            session_id=target_handle.session_id,
            committed_len=len(prompt),
        ),
        sampling=sampling,
        speculation=common_pb2.SpeculationParams(num_speculative_tokens=4),
    )
    return target_stub, draft_stub, request


def _tree(spans: list[dict], trace_id: str) -> tuple[dict[str, dict], dict[str, list[dict]]]:
    in_trace = [s for s in spans if s["trace_id"] == trace_id]
    by_id = {s["span_id"]: s for s in in_trace}
    children: dict[str, list[dict]] = {}
    for span in in_trace:
        children.setdefault(span["parent_span_id"], []).append(span)
    return by_id, children


def _only_child(children, parent: dict, name: str) -> dict:
    matches = [s for s in children.get(parent["span_id"], []) if s["name"] == name]
    assert len(matches) == 1, (
        f"{name} under {parent['name']}: {[s['name'] for s in children.get(parent['span_id'], [])]}"
    )
    return matches[0]


def test_a_speculation_is_one_trace_from_client_to_target(traced, workers, prompt_ids):
    installed, trace_file = traced
    prompt = prompt_ids[3]  # "abcabc...": the n-gram drafter proposes
    _, draft_stub, request = _open_both(installed, workers, prompt, max_new_tokens=24)
    with trace.get_tracer("test").start_as_current_span("test.request") as root:
        updates = list(draft_stub.Speculate(request, timeout=DEADLINE_S))
    trace_id = f"{root.get_span_context().trace_id:032x}"
    spans = _spans_with(
        installed, trace_file, trace_id, "/specdec.v1.TargetService/Verify", "CLIENT"
    )
    by_id, children = _tree(spans, trace_id)
    root_span = by_id[f"{root.get_span_context().span_id:016x}"]

    # client Speculate -> draft's server span -> rounds, and the Verify stream -> target.
    client = _only_child(children, root_span, "/specdec.v1.DraftService/Speculate")
    assert client["kind"] == "CLIENT"
    server = _only_child(children, client, "/specdec.v1.DraftService/Speculate")
    assert server["kind"] == "SERVER"
    rounds = sorted(
        (s for s in children[server["span_id"]] if s["name"] == "specdec.round"),
        key=lambda s: s["attributes"]["specdec.round"],
    )
    verify_client = _only_child(children, server, "/specdec.v1.TargetService/Verify")
    verify_server = _only_child(children, verify_client, "/specdec.v1.TargetService/Verify")
    # Proposals drafted ahead on a context that turned out wrong were discarded: no round.
    verifies = sorted(
        (
            s
            for s in children[verify_server["span_id"]]
            if s["name"] == "specdec.verify" and not s["attributes"]["specdec.discarded"]
        ),
        key=lambda s: s["attributes"]["specdec.round"],
    )

    # One round span per update, with the update's numbers; the target saw the same rounds.
    assert len(rounds) == len(updates) == len(verifies) > 1
    for span, update, verify in zip(rounds, updates, verifies):
        a = span["attributes"]
        assert a["specdec.round"] == update.round.round == verify["attributes"]["specdec.round"]
        assert a["specdec.k"] == update.round.num_drafted == verify["attributes"]["specdec.k"]
        assert a["specdec.max_k"] == 4 and a["specdec.adaptive"] is False
        assert (
            a["specdec.accepted"]
            == update.round.num_accepted
            == verify["attributes"]["specdec.accepted"]
        )
        assert a["specdec.committed"] == len(update.token_ids)
        assert a["specdec.verify_ns"] == update.round.verify_rtt_ns
        assert (
            a["specdec.target_compute_ns"]
            == update.round.target_compute_ns
            == verify["attributes"]["specdec.target_compute_ns"]
        )
        check_round_times(a)
        assert a["specdec.proposal_bytes"] == update.round.proposal_bytes > 0
        assert a["specdec.verdict_bytes"] == update.round.verdict_bytes > 0
        assert server["start_ns"] <= span["start_ns"] <= span["end_ns"] <= server["end_ns"]
        assert span["resource"]["service.name"] == "test"
    assert (
        sum(a["attributes"]["specdec.committed"] for a in rounds)
        == sum(len(u.token_ids) for u in updates)
        == 24
    )
    assert any(s["attributes"]["specdec.k"] > 0 for s in rounds)
    assert rounds[-1]["attributes"]["specdec.finish_reason"] == "length"


def test_prefill_spans_on_both_workers(traced, workers, prompt_ids):
    installed, trace_file = traced
    with trace.get_tracer("test").start_as_current_span("test.open") as root:
        _open_both(installed, workers, prompt_ids[0], max_new_tokens=4)
    trace_id = f"{root.get_span_context().trace_id:032x}"
    by_id, children = _tree(_spans(installed, trace_file), trace_id)
    prefills = [s for s in by_id.values() if s["name"] == "specdec.prefill"]
    assert len(prefills) == 2
    for span in prefills:
        server = by_id[span["parent_span_id"]]
        assert server["kind"] == "SERVER" and server["name"].endswith("/OpenSession")
        assert span["attributes"]["specdec.tokens"] == len(prompt_ids[0])
        assert span["attributes"]["specdec.prefill_ns"] > 0


def test_a_traced_stream_can_still_be_cancelled(traced, workers, prompt_ids):
    """opentelemetry-python-contrib #2014: the library's client interceptor returns a
    generator for server streams; ours keeps the call object."""
    installed, trace_file = traced
    target_stub = target_pb2_grpc.TargetServiceStub(
        installed.intercept_channel(grpc.insecure_channel(workers.target))
    )
    handle = target_stub.OpenSession(
        target_pb2.OpenSessionRequest(
            prompt_token_ids=prompt_ids[1], sampling=common_pb2.SamplingParams(max_new_tokens=60)
        ),
        timeout=DEADLINE_S,
    ).handle
    call = target_stub.Decode(
        target_pb2.DecodeRequest(session_id=handle.session_id, base_len=len(prompt_ids[1])),
        timeout=DEADLINE_S,
    )
    next(call)
    call.cancel()
    with pytest.raises(grpc.RpcError) as error:
        list(call)
    assert error.value.code() == grpc.StatusCode.CANCELLED
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        clients = [
            s
            for s in _spans(installed, trace_file)
            if s["name"] == "/specdec.v1.TargetService/Decode" and s["kind"] == "CLIENT"
        ]
        if clients:
            break
        time.sleep(0.05)
    assert (
        len(clients) == 1
        and clients[0]["attributes"]["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    )


def test_health_checks_and_info_are_not_traced(traced, workers):
    installed, trace_file = traced
    channel = installed.intercept_channel(grpc.insecure_channel(workers.target))
    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S)
    target_pb2_grpc.TargetServiceStub(channel).Info(common_pb2.InfoRequest(), timeout=DEADLINE_S)
    names = {s["name"] for s in _spans(installed, trace_file)}
    assert not [n for n in names if "grpc.health" in n or n.endswith("/Info")]


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=DEADLINE_S) as response:
        return response.read().decode()


def _sample(text: str, name: str, **labels) -> float:
    """The value of one Prometheus sample whose labels include `labels`."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                return float(value)
    raise AssertionError(f"no sample {name} {labels} in:\n{text}")


def test_prometheus_names_of_the_hpa_contract(traced):
    """The HPA reads specdec_worker_sessions_active and specdec_worker_load: exact names."""
    installed, _ = traced
    load = telemetry.WorkerLoad(
        active_sessions=3, max_sessions=12, cached_tokens=500, max_cached_tokens=1000
    )
    installed.register_load_gauges(lambda: load, {"specdec.worker.id": "gauge-test"})
    text = _scrape(installed.metrics_port)
    assert _sample(text, "specdec_worker_sessions_active", specdec_worker_id="gauge-test") == 3
    # tokens: the fuller budget
    assert _sample(text, "specdec_worker_load", specdec_worker_id="gauge-test") == 0.5
    assert _sample(text, "specdec_worker_cached_tokens", specdec_worker_id="gauge-test") == 500
    assert "# TYPE specdec_worker_sessions_active gauge" in text
    assert "# TYPE specdec_worker_load gauge" in text


# The gauges of admission and batching, exported by a worker with admission (the target).
ADMISSION_GAUGES = (
    "specdec_worker_calls_running",
    "specdec_worker_calls_queued",
    "specdec_worker_calls_max_running",
    "specdec_worker_calls_utilization",
    "specdec_worker_batch_mean_tokens",
    "specdec_worker_batch_max_tokens",
)


def test_prometheus_names_of_the_admission_gauges(traced):
    """The target HPA reads specdec_worker_calls_utilization: (running + queued) per
    running slot, above 1 when calls queue. A worker without admission (the draft)
    exports none of these gauges, only the session ones."""
    installed, _ = traced
    load = telemetry.WorkerLoad(
        active_sessions=5,
        max_sessions=32,
        cached_tokens=100,
        max_cached_tokens=1000,
        running_calls=4,
        queued_calls=2,
        max_running=4,
        mean_batch_tokens=17.5,
        max_batch_tokens=512,
    )
    installed.register_load_gauges(lambda: load, {"specdec.worker.id": "admission-test"})
    no_admission = telemetry.WorkerLoad(
        active_sessions=1, max_sessions=8, cached_tokens=10, max_cached_tokens=100
    )
    installed.register_load_gauges(lambda: no_admission, {"specdec.worker.id": "no-admission-test"})
    text = _scrape(installed.metrics_port)
    labels = {"specdec_worker_id": "admission-test"}
    # (4 + 2) / 4: queueing
    assert _sample(text, "specdec_worker_calls_utilization", **labels) == 1.5
    assert _sample(text, "specdec_worker_calls_running", **labels) == 4
    assert _sample(text, "specdec_worker_calls_queued", **labels) == 2
    assert _sample(text, "specdec_worker_calls_max_running", **labels) == 4
    assert _sample(text, "specdec_worker_batch_mean_tokens", **labels) == 17.5
    assert _sample(text, "specdec_worker_batch_max_tokens", **labels) == 512
    assert _sample(text, "specdec_worker_load", **labels) == 5 / 32  # memory only, as before
    for name in ADMISSION_GAUGES:
        assert f"# TYPE {name} gauge" in text
        with pytest.raises(AssertionError, match="no sample"):
            _sample(text, name, specdec_worker_id="no-admission-test")
    assert (
        _sample(text, "specdec_worker_sessions_active", specdec_worker_id="no-admission-test") == 1
    )


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_target_exports_its_batched_steps_and_admission(traced, workers, prompt_ids):
    """A real target's gauges: its running slots and step budget, the mean tokens of the
    steps its calls ran in (equal to what Info reports), and the draft has none."""
    installed, _ = traced
    target = workers.target_servicer
    stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(workers.target))
    prompt = prompt_ids[0]
    handle = stub.OpenSession(
        target_pb2.OpenSessionRequest(
            prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_new_tokens=8)
        ),
        timeout=DEADLINE_S,
    ).handle
    tokens = list(
        stub.Decode(
            target_pb2.DecodeRequest(session_id=handle.session_id, base_len=len(prompt)),
            timeout=DEADLINE_S,
        )
    )
    assert tokens
    _wait_for(lambda: target.admission.load().running == 0, "the Decode call kept its slot")
    text = _scrape(installed.metrics_port)
    info = stub.Info(common_pb2.InfoRequest(), timeout=DEADLINE_S).load
    labels = {"specdec_worker_id": "target-t"}
    assert (
        _sample(text, "specdec_worker_calls_max_running", **labels)
        == target.admission.max_running
        == info.max_running
        > 0
    )
    assert (
        _sample(text, "specdec_worker_batch_max_tokens", **labels)
        == info.max_batch_tokens
        == target.sessions.compute.max_batch_tokens
    )
    mean = _sample(text, "specdec_worker_batch_mean_tokens", **labels)
    # the prefill and decode steps ran
    assert mean > 0 and mean == pytest.approx(info.mean_batch_tokens)
    assert _sample(text, "specdec_worker_calls_running", **labels) == info.running_calls == 0
    assert _sample(text, "specdec_worker_calls_queued", **labels) == info.queued_calls == 0
    assert _sample(text, "specdec_worker_calls_utilization", **labels) == 0
    assert _sample(text, "specdec_worker_sessions_active", **labels) >= 1
    for name in ADMISSION_GAUGES:  # no admission on the draft worker
        with pytest.raises(AssertionError, match="no sample"):
            _sample(text, name, specdec_worker_id="draft-t")
    assert _sample(text, "specdec_worker_sessions_active", specdec_worker_id="draft-t") >= 0
    stub.CloseSession(
        common_pb2.CloseSessionRequest(session_id=handle.session_id), timeout=DEADLINE_S
    )


def test_draft_exports_its_rounds_draft_to_verify_time_ratio(traced, workers, prompt_ids):
    """A real draft worker's gauge after its rounds: their drafting over the target's
    verifying time (the draft HPA's metric), the value of its window; none on the target."""
    installed, _ = traced
    _, draft_stub, request = _open_both(installed, workers, prompt_ids[3], max_new_tokens=16)
    updates = list(draft_stub.Speculate(request, timeout=DEADLINE_S))
    assert any(u.round.num_drafted > 0 and u.round.draft_ns > 0 for u in updates)
    text = _scrape(installed.metrics_port)
    ratio = _sample(text, "specdec_worker_draft_verify_time_ratio", specdec_worker_id="draft-t")
    assert ratio > 0 and ratio == pytest.approx(workers.draft_servicer.round_times.ratio())
    assert "# TYPE specdec_worker_draft_verify_time_ratio gauge" in text
    with pytest.raises(AssertionError, match="no sample"):
        _sample(text, "specdec_worker_draft_verify_time_ratio", specdec_worker_id="target-t")


def test_target_gauges_show_running_and_queued_calls(traced, tiny_target):
    """A target whose one running slot is taken and whose queue holds a call reports
    2 calls per slot: the HPA's metric grows with the queue."""
    installed, _ = traced
    sessions = TargetSessions(tiny_target, 4, 10_000)
    target = TargetServicer(
        sessions,
        "target-queue",
        model_info(tiny_target, "cpu"),
        8,
        admission=Admission(max_running=1, max_queued=2),
    )
    labels = {"specdec_worker_id": "target-queue"}
    queued_waited: list[int] = []
    try:
        assert target.admission.acquire(None) == 0  # the one running slot
        waiter = threading.Thread(
            target=lambda: queued_waited.append(target.admission.acquire(DEADLINE_S))
        )
        waiter.start()
        _wait_for(lambda: target.admission.load().queued == 1, "the second call did not queue")
        text = _scrape(installed.metrics_port)
        assert _sample(text, "specdec_worker_calls_running", **labels) == 1
        assert _sample(text, "specdec_worker_calls_queued", **labels) == 1
        assert _sample(text, "specdec_worker_calls_max_running", **labels) == 1
        assert _sample(text, "specdec_worker_calls_utilization", **labels) == 2.0
        target.admission.release()  # hands the slot to the queued call
        waiter.join(DEADLINE_S)
        assert queued_waited and queued_waited[0] > 0
        text = _scrape(installed.metrics_port)
        assert _sample(text, "specdec_worker_calls_queued", **labels) == 0
        assert _sample(text, "specdec_worker_calls_utilization", **labels) == 1.0
        target.admission.release()
        assert (
            _sample(_scrape(installed.metrics_port), "specdec_worker_calls_utilization", **labels)
            == 0
        )
    finally:
        sessions.compute.stop()


def test_round_counters_and_histograms(traced):
    installed, _ = traced
    before = _scrape(installed.metrics_port)

    def value(text, name, **labels):
        try:
            return _sample(text, name, **labels)
        except AssertionError:
            return 0.0

    instruments = telemetry.instruments()
    stats = RoundStats(
        index=0,
        base_len=10,
        num_drafted=3,
        num_accepted=2,
        num_committed=3,
        next_token_kind=NextTokenKind.RECOVERED,
        draft_ns=1_000_000,
        verify_ns=5_000_000,
        target_compute_ns=4_000_000,
    )
    instruments.record_round(stats)
    instruments.fallbacks.add(1)
    instruments.failovers.add(1, {"pool": "target"})
    instruments.time_per_output_token.record(0.05)
    after = _scrape(installed.metrics_port)
    for name, labels, delta in (
        ("specdec_rounds_total", {}, 1),
        ("specdec_drafts_total", {}, 1),
        ("specdec_draft_tokens_total", {"position": 2}, 1),
        ("specdec_accepted_tokens_total", {"position": 1}, 1),
        ("specdec_fallbacks_total", {}, 1),
        ("specdec_failovers_total", {"pool": "target"}, 1),
        ("specdec_round_duration_seconds_count", {"phase": "network"}, 1),
        ("gen_ai_server_time_per_output_token_seconds_count", {}, 1),
    ):
        assert value(after, name, **labels) - value(before, name, **labels) == delta, name
    assert value(after, "specdec_accepted_tokens_total", position=2) == value(
        before, "specdec_accepted_tokens_total", position=2
    )
    # network = verify - target compute = 1 ms: in the (0.0005, 0.001] bucket.
    assert (
        value(after, "specdec_round_duration_seconds_bucket", phase="network", le="0.001")
        - value(before, "specdec_round_duration_seconds_bucket", phase="network", le="0.001")
        == 1
    )


def test_time_per_output_token_is_the_time_after_the_first_token():
    """(last token - first) / (tokens - 1), as vLLM defines it: a round of 3 tokens at
    10 ms, one at 20 ms and a round of 2 at 40 ms: 30 ms over 5 tokens after the first."""
    output = telemetry.OutputTiming()
    assert output.time_per_output_token_ns is None
    for num_tokens, at_ms in ((3, 10), (0, 15), (1, 20), (2, 40)):
        output.add(num_tokens, at_ms * 1_000_000)
    assert output.num_tokens == 6
    assert output.time_per_output_token_ns == 6_000_000
    one = telemetry.OutputTiming()
    one.add(1, 5)
    assert one.time_per_output_token_ns is None  # no token after the first


def test_bad_settings_are_refused():
    with pytest.raises(InvalidArgument, match="trace_exporter"):
        telemetry.setup("x", TelemetryConfig(trace_exporter="zipkin"))
    with pytest.raises(InvalidArgument, match="trace_file"):
        telemetry.setup("x", TelemetryConfig(trace_exporter="jsonl"))
    with pytest.raises(InvalidArgument, match="metrics_port"):
        telemetry.setup("x", TelemetryConfig(metrics_port=-1))


def test_processes_can_share_one_span_file(tmp_path):
    """Each span is one write() with O_APPEND: lines from concurrent writers never mix."""
    path = tmp_path / "shared.jsonl"
    script = f"""
import sys
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from service_common.telemetry import JsonLinesSpanExporter
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter({str(path)!r})))
tracer = provider.get_tracer("w")
for i in range(300):
    with tracer.start_as_current_span("w" + sys.argv[1], attributes={{"pad": "x" * 3000, "i": i}}):
        pass
"""
    writers = [subprocess.Popen([sys.executable, "-c", script, str(n)], cwd=REPO) for n in range(3)]
    assert all(w.wait(timeout=120) == 0 for w in writers)
    lines = path.read_text().splitlines()
    assert len(lines) == 900
    spans = [json.loads(line) for line in lines]
    assert {s["name"] for s in spans} == {"w0", "w1", "w2"}


def test_off_installs_nothing_and_costs_nothing(tmp_path):
    """Fresh interpreter: with "none", no provider, no interceptor, and a round's span and
    metrics cost microseconds (a round takes milliseconds)."""
    script = """
import time, grpc
from types import SimpleNamespace
from speculative.policy import FixedK
from opentelemetry import metrics, trace
from service_common import telemetry
from service_common.options import TelemetryConfig
from draft_service import speculation
from specdec.v1 import draft_pb2
from speculative.speculation_loop import RoundResult
from speculative.rejection import NextTokenKind
from speculative.stats import RoundStats
installed = telemetry.setup("draft", TelemetryConfig())
assert not installed.tracing and installed.meter_provider is None
assert installed.server_interceptors() == []
channel = grpc.insecure_channel("127.0.0.1:1")
assert installed.intercept_channel(channel) is channel
assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"
assert type(metrics.get_meter_provider()).__name__ == "_ProxyMeterProvider"
stats = RoundStats(index=0, base_len=10, num_drafted=4, num_accepted=2, num_committed=3,
                   next_token_kind=NextTokenKind.RECOVERED, draft_ns=1000, verify_ns=5000, target_compute_ns=4000)
result = RoundResult([1, 2, 3], stats, None)
update = draft_pb2.SpeculateUpdate()
plan = SimpleNamespace(policy=FixedK(4))
n = 2000
start = time.perf_counter()
for _ in range(n):
    speculation._observe_round(update, result, "s", plan, 0, 1)
per_round_us = (time.perf_counter() - start) / n * 1e6
print(per_round_us)
assert per_round_us < 200, per_round_us
"""
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
