"""The load scenario (benchmarks/bench_load.py): its statistics (percentiles, per-token
latency, ratios, the exactness check) and one small run
through the services with a tiny random model at concurrency 1 and 2."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_load import (
    Cell,
    RequestRecord,
    check_exactness,
    inter_token_times,
    load_methods,
    main,
    percentile,
    pooled,
    ratio,
    steady_window,
    summarize,
)
from benchmarks.common import round_order


def test_percentile_interpolates_between_closest_ranks():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(range(1, 101)), 95) == pytest.approx(95.05)
    assert percentile([7.0], 95) == 7.0
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0
    assert percentile([], 50) is None


def test_a_chunk_of_n_tokens_counts_n_tokens_of_its_gap_over_n():
    # First chunk (2 tokens) is the time to first token; then 1 token after 0.1 s, 4 after 0.2 s.
    samples = inter_token_times([1.0, 1.1, 1.3], [2, 1, 4])
    assert samples == pytest.approx([0.1, 0.05, 0.05, 0.05, 0.05])
    assert sum(samples) == pytest.approx(1.3 - 1.0)
    assert inter_token_times([1.0], [3]) == []


def test_ratio_is_none_without_a_base():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(3.0, None) is None and ratio(3.0, 0.0) is None


def _record(prompt, tokens, start, chunks, status="OK", queue_ns=0):
    record = RequestRecord("k=4", prompt, 0, start_s=start, status=status, queue_ns=queue_ns)
    for at, ids in chunks:
        record.chunk_s.append(at)
        record.chunk_tokens.append(len(ids))
        record.token_ids += ids
    record.end_s = chunks[-1][0] if chunks else start
    assert record.token_ids == tokens
    return record


def test_summary_counts_tokens_failures_by_code_and_latencies():
    records = [
        _record("a", [1, 2, 3], 0.0, [(0.1, [1]), (0.3, [2, 3])], queue_ns=2_000_000),
        _record("b", [4, 5], 0.5, [(0.7, [4]), (0.8, [5])], queue_ns=4_000_000),
        _record("a", [], 0.0, [], status="RESOURCE_EXHAUSTED"),
        _record("a", [], 0.0, [], status="DEADLINE_EXCEEDED"),
        _record("b", [], 0.0, [], status="RESOURCE_EXHAUSTED"),
    ]
    s = summarize(Cell("closed", "k=4", 2, 1.0, records))
    assert (s.completed, s.failed) == (2, {"RESOURCE_EXHAUSTED": 2, "DEADLINE_EXCEEDED": 1})
    assert s.tokens_per_s == pytest.approx(5.0) and s.requests_per_s == pytest.approx(2.0)
    assert s.ttft_p50_ms == pytest.approx(150.0)  # TTFTs 100 and 200 ms
    assert s.per_token_p50_ms == pytest.approx(100.0)  # samples 100, 100 and 100 ms
    assert s.queue_p50_ms == pytest.approx(3.0) and s.queue_p95_ms == pytest.approx(3.9)
    assert s.e2e_p95_s == pytest.approx(0.3)


def test_steady_throughput_counts_only_while_every_client_is_in_flight():
    """Client 0 ends its last request at 1.0 s; client 1 runs on alone until 3.0 s:
    the steady window is 0 to 1.0 s and holds the tokens that arrived in it."""
    records = [
        _record("a", [1, 2], 0.0, [(0.4, [1]), (1.0, [2])]),
        _record("a", [3, 4, 5], 0.0, [(0.5, [3, 4]), (2.0, [5])]),
        _record("b", [6, 7], 2.0, [(2.5, [6]), (3.0, [7])]),
    ]
    records[0].client, records[1].client, records[2].client = 0, 1, 1
    assert steady_window(records) == (4, 1.0)
    one = Cell("closed", "k=0", 2, 3.0, records, steady=steady_window(records))
    assert summarize(one).steady_tokens_per_s == pytest.approx(4.0)
    assert summarize(one).tokens_per_s == pytest.approx(7 / 3)
    both = pooled([one, Cell("closed", "k=0", 2, 1.0, records[:1], repeat=1, steady=(2, 1.0))])
    assert both.steady == (6, 2.0) and both.seconds == 4.0 and len(both.records) == 4


def test_every_completed_output_is_checked_against_its_prompts_reference():
    records = [
        _record("a", [1, 2, 3], 0.0, [(0.1, [1, 2, 3])]),
        _record("b", [4, 9], 0.0, [(0.1, [4, 9])]),
        _record("b", [], 0.0, [], status="UNAVAILABLE"),
    ]
    cell = Cell("closed", "k=4", 2, 1.0, records)
    lines = check_exactness(cell, {"a": [1, 2, 3], "b": [4, 5, 6]})
    assert [r.matches_reference for r in records] == [True, False, None]
    assert (
        len(lines) == 1
        and "prompt b: first difference at token 1, expected [5, 6], got [9]" in lines[0]
    )
    assert summarize(cell).mismatches == 1


def test_methods_take_every_position_in_turn():
    methods = load_methods(4, 4)
    assert [m.name for m in methods] == ["k=0", "k=4", "adaptive k<=4"]
    assert methods[2].adaptive and methods[2].k == 4 and methods[0].k == 0
    firsts = {round_order(methods, turn)[0].name for turn in range(3)}
    assert firsts == {"k=0", "k=4", "adaptive k<=4"}


def test_a_small_run_through_the_services_is_exact_and_complete(tmp_path):
    status = main(
        [
            "--pair",
            "tiny",
            "--concurrency",
            "1,2",
            "--max-new-tokens",
            "8",
            "--requests-per-client",
            "2",
            "--repeats",
            "2",
            "--threads",
            "1",
            "--out",
            str(tmp_path / "load.md"),
        ]
    )
    assert status == 0
    [runs] = json.loads((tmp_path / "load.json").read_text())
    assert runs["mismatches"] == [] and len(runs["reference"]) >= 8
    cells = {(c["phase"], c["method"], c["load"], c.get("repeat")): c for c in runs["cells"]}
    for method in ("k=0", "k=4", "adaptive k<=4"):
        for concurrency in (1, 2):
            for repeat in (0, 1):
                cell = cells[("closed", method, concurrency, repeat)]
                assert (
                    cell["summary"]["completed"] == 2 * concurrency
                    and cell["summary"]["failed"] == {}
                )
                assert all(
                    r["matches_reference"] and r["num_tokens"] > 0 and r["chunk_s"]
                    for r in cell["requests"]
                )
                assert cell["summary"]["ttft_p95_ms"] > 0 and cell["summary"]["tokens_per_s"] > 0
                assert cell["summary"]["steady_tokens_per_s"] > 0
    text = (tmp_path / "load.md").read_text()
    assert "Command: `python -m benchmarks load --pair tiny" in text and "`nproc`" in text
    assert "#### adaptive k<=4" in text
    assert "#### Paired: steady tok/s over k=0's, per repeat" in text
    assert "outputs equal the k=0 reference" in text and "Incomplete" not in text
