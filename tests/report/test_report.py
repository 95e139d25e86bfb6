"""`python -m report` on synthetic traces whose answers are computed by hand below."""

from __future__ import annotations

import json
import math

import pytest

from foundation.pass_cost import PassCost
from report.__main__ import main
from report.analysis import analyse
from report.live import render_live, scrape
from report.model import CostModel, alpha_from_rounds, expected_tokens, fit_verify
from report.traces import read_spans

MS = 1_000_000  # ns

# Ten rounds at k = 4: 24 of 40 draft tokens accepted; 6 rounds end in a rejection, so
# the per-token acceptance (maximum likelihood, i.i.d. model) is alpha = 24 / (24 + 6) = 0.8.
ACCEPTED = [4, 4, 2, 0, 1, 4, 3, 0, 2, 4]
# Each round: 4 ms drafting (1 ms per draft token), 12 ms target compute in a 14 ms round
# trip (2 ms network), nothing else: 18 ms.
DRAFT_NS, COMPUTE_NS, VERIFY_NS, ROUND_NS = 4 * MS, 12 * MS, 14 * MS, 18 * MS
# of the 2 ms beside the target's pass, the target's own host work; the rest the transport
HOST_NS = 1 * MS
# Target-only decoding: 10 ms per token, of which 8 ms is the one-token forward pass.
DECODE_NS, DECODE_COMPUTE_NS = 10 * MS, 8 * MS

# By hand:
# E[tokens](4) = (1 - 0.8^5) / (1 - 0.8) = (1 - 0.32768) / 0.2 = 3.3616
# t_verify(k): a line through (k=0, 8 ms) and (k=4, 12 ms) = 8 ms + 1 ms * k
# break-even R at k=4 = 3.3616 * 10 - 4 * 1 - 12 = 17.616 ms
# predicted speedup at the measured R = 2 ms: 33.616 / (4 + 12 + 2) = 1.8676
# measured: 34 tokens in 10 * 18 ms -> 180 / 34 = 5.294 ms per token -> 10 / 5.294 = 1.889x
# best k at R = 2 ms: 10 E(k) / (10 + 2k) = 1.50, 1.743, 1.845, 1.868, 1.845 (k = 1..5) -> 4
# best k at R = 0: 10 E(k) / (8 + 2k) = ..., k=3: 29.52 / 14 = 2.109, k=4: 33.616 / 16 = 2.101 -> 3
BREAK_EVEN_MS = 17.616


def _span(name, trace, index, start_ns, duration_ns, attributes, service, parent=None):
    return {
        "name": name,
        "kind": "INTERNAL",
        "trace_id": trace * 32,
        "span_id": f"{index:016x}",
        "parent_span_id": parent,
        "start_ns": start_ns,
        "end_ns": start_ns + duration_ns,
        "status": "UNSET",
        "attributes": attributes,
        "resource": {"service.name": service},
    }


def synthetic_spans() -> list[dict]:
    spans = [_span("/specdec.v1.DraftService/Speculate", "a", 1, 0, 200 * MS, {}, "draft")]
    for i, accepted in enumerate(ACCEPTED):
        spans.append(
            _span(
                "specdec.round",
                "a",
                100 + i,
                i * ROUND_NS,
                ROUND_NS,
                {
                    "specdec.round": i,
                    "specdec.k": 4,
                    "specdec.accepted": accepted,
                    "specdec.committed": accepted + 1,
                    "specdec.draft_ns": DRAFT_NS,
                    "specdec.verify_ns": VERIFY_NS,
                    "specdec.target_compute_ns": COMPUTE_NS,
                    "specdec.network_ns": VERIFY_NS - COMPUTE_NS,
                    "specdec.transport_ns": VERIFY_NS - COMPUTE_NS - HOST_NS,
                    "specdec.target_handled_ns": COMPUTE_NS + HOST_NS,
                    "specdec.target_host_ns": HOST_NS,
                },
                "draft",
                parent=f"{1:016x}",
            )
        )
    spans.append(
        _span("specdec.rollback", "a", 3, 0, 1 * MS, {"specdec.cut_tokens": 2}, "orchestrator")
    )
    spans.append(
        _span(
            "specdec.failover", "a", 4, 0, 1 * MS, {"specdec.lost": ["target:t1"]}, "orchestrator"
        )
    )
    spans.append(_span("/specdec.v1.TargetService/Decode", "b", 2, 0, 200 * MS, {}, "target"))
    for i in range(20):
        spans.append(
            _span(
                "specdec.decode",
                "b",
                200 + i,
                i * DECODE_NS,
                DECODE_NS,
                {"specdec.target_compute_ns": DECODE_COMPUTE_NS},
                "target",
                parent=f"{2:016x}",
            )
        )
    return spans


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in synthetic_spans()))
    return path


def test_the_model_by_hand():
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616)
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    model = CostModel(
        alpha=0.8,
        target_step_ns=10 * MS,
        draft_step_ns=1 * MS,
        verify=PassCost(8 * MS, 1 * MS),
    )
    assert model.break_even_delay_ns(4) == pytest.approx(BREAK_EVEN_MS * MS)
    assert model.speedup(4, BREAK_EVEN_MS * MS) == pytest.approx(1.0)
    assert model.speedup(4, 2 * MS) == pytest.approx(33.616 / 18)
    assert model.best_k(2 * MS) == 4
    assert model.best_k(0.0) == 3
    # Drafting in half the rounds (an n-gram drafter without a match in the others):
    # tokens per round 0.5 * 3.3616 + 0.5 = 2.1808; round 0.5 * (4 + 12) + 0.5 * 8 = 12 ms + R.
    half = CostModel(0.8, 10 * MS, 1 * MS, PassCost(8 * MS, 1 * MS), draft_fraction=0.5)
    assert half.speedup(4, 2 * MS) == pytest.approx(21.808 / 14)
    assert half.break_even_delay_ns(4) == pytest.approx(9.808 * MS)
    # A draft that is never right only costs: the best k still loses.
    assert CostModel(0.0, 10 * MS, 1 * MS, PassCost(9 * MS, 1 * MS)).speedup(
        1, 0.0
    ) == pytest.approx(10 / 11)


def test_alpha_and_verify_fit():
    assert alpha_from_rounds([(4, a) for a in ACCEPTED]) == pytest.approx(0.8)
    assert alpha_from_rounds([(4, 4), (0, 0)]) == 1.0  # nothing rejected; k=0 rounds ignored
    assert fit_verify([(4, 12 * MS, 10), (0, 8 * MS, 20)]) == pytest.approx((8 * MS, 1 * MS, 0.0))
    assert fit_verify([(4, 12 * MS, 10)]) == PassCost(12 * MS, 0.0)  # one width: flat
    assert fit_verify([(0, 12 * MS, 1), (4, 10 * MS, 1)]) == PassCost(
        11 * MS, 0.0
    )  # falling: noise, flat


def test_report_numbers_from_a_trace(trace_file):
    report = analyse(read_spans([trace_file]))
    assert report.num_generated == 34
    assert report.acceptance_rate == pytest.approx(24 / 40)
    assert report.mean_accepted_length == pytest.approx(2.4)
    assert report.acceptance_by_position == [(8, 10), (7, 10), (5, 10), (4, 10)]
    assert report.mean_split_ns() == pytest.approx(
        {
            "draft": 4 * MS,
            "target compute": 12 * MS,
            "target host": 1 * MS,
            "transport": 1 * MS,
            "other": 0,
            "total": 18 * MS,
        }
    )
    assert report.target_step_source == "measured" and report.target_step_ns == 10 * MS
    assert report.measured_speedup == pytest.approx(10 / (180 / 34))
    model = report.model
    assert model.alpha == pytest.approx(0.8)
    assert model.verify == pytest.approx((8 * MS, 1 * MS, 0.0))
    assert model.draft_step_ns == pytest.approx(1 * MS)
    assert report.mean_delay_ns == pytest.approx(2 * MS)
    assert model.break_even_delay_ns(4) == pytest.approx(BREAK_EVEN_MS * MS)


def test_cli_prints_the_numbers_and_writes_plots(trace_file, tmp_path, capsys):
    assert main([str(trace_file), "--plots", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "failovers: 1 (lost: target:t1 x1)" in out
    assert "rollbacks: 1, 1 of them cut generated tokens at a stop string (2 tokens)" in out
    assert "acceptance rate: 60.0% of drafted tokens" in out
    assert "mean accepted length: 2.40 tokens per drafting round" in out
    assert "acceptance by position: 1:80%(10) 2:70%(10) 3:50%(10) 4:40%(10)" in out
    assert (
        "draft 4.00 ms (22%), target compute 12.00 ms (67%), target host 1.00 ms (6%), transport 1.00 ms (6%), "
        "other 0.00 ms (0%)"
    ) in out
    assert "target-only decoding: 10.00 ms per token (measured" in out
    assert "measured speedup 1.89x" in out
    assert "alpha 0.800" in out
    assert (
        f"at k=4: predicted speedup 1.87x; break-even round-trip delay R = {BREAK_EVEN_MS:.2f} ms"
        in out
    )
    assert f"stops paying at {(BREAK_EVEN_MS - 2) / 2:.2f} ms added one-way delay" in out
    assert "best k at the measured R: k=4 (1.87x)" in out
    assert "best k at R = 0: k=3 (2.11x)" in out
    for name in ("speedup_vs_k.png", "speedup_vs_delay.png"):
        png = (tmp_path / "plots" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_target_step_given_or_estimated(trace_file, tmp_path):
    given = analyse(read_spans([trace_file]), target_step_ns=20 * MS)
    assert given.target_step_source == "given" and given.measured_speedup == pytest.approx(
        20 / (180 / 34)
    )
    # Without target-only spans: the fitted one-token verification, flat at 12 ms here
    # (one width only), and the report says it is an estimate.
    only_rounds = tmp_path / "rounds.jsonl"
    only_rounds.write_text(
        "".join(json.dumps(s) + "\n" for s in synthetic_spans() if s["trace_id"][0] == "a")
    )
    estimated = analyse(read_spans([only_rounds]))
    assert (
        estimated.target_step_source == "estimated"
        and estimated.target_step_ns == pytest.approx(12 * MS)
    )


def test_no_rounds_is_said_plainly(tmp_path, capsys):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    assert main([str(path)]) == 0
    assert "no specdec.round spans" in capsys.readouterr().out


def test_live_metrics_text():
    """The same rounds as counters: fixed k = 4, so alpha is exact."""
    samples = {
        "specdec_rounds_total": [({}, 10.0)],
        "specdec_drafts_total": [({}, 10.0)],
        "specdec_draft_tokens_total": [({"position": str(i)}, 10.0) for i in range(4)],
        "specdec_accepted_tokens_total": [
            ({"position": str(i)}, float(n)) for i, n in enumerate((8, 7, 5, 4))
        ],
        "specdec_round_duration_seconds_sum": [
            ({"phase": "draft"}, 0.04),
            ({"phase": "verify_compute"}, 0.12),
            ({"phase": "network"}, 0.02),
        ],
        "specdec_round_duration_seconds_count": [
            ({"phase": p}, 10.0) for p in ("draft", "verify_compute", "network")
        ],
    }
    out = render_live(samples, target_step_ns=10 * MS)
    assert "acceptance rate: 60.0%" in out and "1:80% 2:70% 3:50% 4:40%" in out
    # flat t_verify = 12 ms: break-even = 33.616 - 4 - 12 = 17.616 ms, as with the trace
    assert f"break-even round-trip delay {BREAK_EVEN_MS:.2f} ms" in out
    assert "alpha 0.800" in out
    assert not math.isnan(float(out.split("speedup ")[1].split("x")[0]))


def test_live_metrics_from_a_real_endpoint():
    """The scraper reads what the exporter serves (names from service_common.telemetry)."""
    import prometheus_client

    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("specdec_rounds", "r", registry=registry).inc(3)
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        samples = scrape([f"http://127.0.0.1:{server.server_port}/metrics"])
        assert samples["specdec_rounds_total"] == [({}, 3.0)]
    finally:
        server.shutdown()
        server.server_close()
