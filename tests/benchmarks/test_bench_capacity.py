"""The capacity scenario (benchmarks/bench_capacity.py): its layouts, its measures counted
as the fleet model counts them, and one small run through pinned services with a tiny
random model and its self-draft."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from benchmarks.bench_capacity import OTHER_CORE, TARGET_CORE, Placement, main, measure
from benchmarks.common import RequestRecord
from planner import fleet


def test_layouts_parse_and_pin_the_draft_by_place():
    assert Placement.parse("remote:5") == Placement("remote", 5.0)
    assert Placement.parse("co-located").label == "co-located"
    assert dict(Placement.parse("co-located").cpus())["draft"] == frozenset({TARGET_CORE})
    remote = dict(Placement.parse("remote:0").cpus())
    assert remote["target"] == frozenset({TARGET_CORE})
    assert remote["draft"] == remote["orchestrator"] == frozenset({OTHER_CORE})
    assert Placement("remote", 5.0).cell(0.5).one_way_ms == (5.5,)
    assert Placement("target-only").cell(0.5).layout is fleet.Layout.TARGET_ONLY
    for bad in ("remote-5", "co-located:3", "local"):
        with pytest.raises(argparse.ArgumentTypeError):
            Placement.parse(bad)


def record(index: int, start: float, chunks: list[float], queue_ms: float = 0.0):
    r = RequestRecord("m", "0", index, start_s=start, scheduled_s=start)
    r.chunk_s, r.chunk_tokens = chunks, [1] * len(chunks)
    r.token_ids, r.queue_ns = list(range(len(chunks))), int(queue_ms * 1e6)
    return r


def test_measure_counts_the_window_and_the_requests_after_the_warmup():
    """Arrivals at 0, 1, 2, 3 s, the first left out: tokens that arrived in [1, 3] s over
    2 s; TPOT and TTFT of the last three only; waits over the window (Little's law)."""
    records = [
        record(0, 0.0, [0.5, 1.5, 2.5]),  # 2 tokens in the window, not in the latencies
        record(1, 1.0, [1.2, 1.4, 1.6], queue_ms=500),
        record(2, 2.0, [2.1, 2.2, 2.3]),
        record(3, 3.0, [3.4, 3.6, 3.8]),  # 0 tokens in the window
    ]
    got = measure(records, [0.0, 1.0, 2.0, 3.0], rate=1.0, warmup=1)
    assert got.tokens_per_s == pytest.approx((2 + 3 + 3) / 2)
    assert got.tpot_p50_ms == pytest.approx(200.0)  # (1.6 - 1.2) / 2 and (3.8 - 3.4) / 2
    assert got.ttft_p90_ms == pytest.approx(360.0)  # of 200, 100, 400 ms (numpy's p90)
    assert got.mean_queue == pytest.approx(0.25)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pins two cores")
def test_a_small_run_is_exact_and_sets_the_model_beside_it(tmp_path):
    out = tmp_path / "capacity.md"
    status = main(
        ["--pair", "tiny-self", "--workload", "in-house", "--per-category", "1"]
        + ["--layouts", "target-only,remote:0", "--rates", "2,6", "--requests", "5"]
        + ["--max-new-tokens", "6", "--out", str(out)]
    )
    assert status == 0
    text = out.read_text()
    assert "Command: `python -m benchmarks capacity --pair tiny-self" in text
    assert "#### remote, 0 ms (measured / model)" in text and "Model against measurement:" in text
    exact = text.split("Exactness: ")[1].split(" outputs")[0].split(" of ")
    assert exact[0] == exact[1] and int(exact[0]) >= 20  # 2 layouts x 2 rates x 5, and more
    costs = json.loads(out.with_suffix(".costs.json").read_text())
    assert costs["target"]["base_ms"] > 0 and costs["draft"]["ms_by_batch"]
    assert out.with_suffix(".png").stat().st_size > 1000
    [raw] = json.loads(out.with_suffix(".json").read_text())
    assert set(raw["cells"]) == {"target-only", "remote, 0 ms"}
    # The model again from the run's records and traces, no measuring: the same tables.
    again = tmp_path / "again.md"
    flags = ["--layouts", "target-only,remote:0", "--rates", "2,6", "--requests", "5"]
    assert main(["--from-run", str(out.with_suffix(".json")), *flags, "--out", str(again)]) == 0
    tables = lambda t: t.split("| layout |")[1].split("Plot:")[0]  # noqa: E731
    assert tables(again.read_text()) == tables(text)
