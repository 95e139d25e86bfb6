"""planner/measured.py: the fleet model's costs from synthetic spans whose true costs are
known, and `python -m planner --traces` on a span file."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from planner.__main__ import main
from planner.costs import Costs, Request
from planner.measured import (
    costs_from_traces,
    draft_step_from_spans,
    link_from_spans,
    target_pass_from_spans,
    target_steps,
)
from report.traces import DECODE_SPAN, PREFILL_SPAN, ROUND_SPAN, VERIFY_SPAN, Span

MS = 1_000_000  # ns


def step_spans(cost, steps: int = 60, seed: int = 0, instance: str = "target-0") -> list[Span]:
    """`steps` target steps of random batches, each as one span per session (verify or
    decode), step_ns = cost(tokens, sessions) ms with 1% noise."""
    rng, spans, start = random.Random(seed), [], 0
    for _ in range(steps):
        sessions = rng.randint(1, 8)
        tokens = sum(rng.randint(1, 6) for _ in range(sessions))
        step_ns = round(cost(tokens, sessions) * MS * rng.uniform(0.99, 1.01))
        for session in range(sessions):
            attributes = {
                "specdec.step_ns": step_ns,
                "specdec.batch_tokens": tokens,
                "specdec.batch_sessions": sessions,
                "specdec.queue_ns": 0,
            }
            name = VERIFY_SPAN if session % 2 else DECODE_SPAN
            spans.append(
                Span(
                    name,
                    "t" * 32,
                    "s" * 16,
                    None,
                    start,
                    start + step_ns,
                    attributes,
                    "target",
                    instance,
                )
            )
        start += step_ns
    return spans


def round_span(
    start_ms: float, draft_ms: float, k: int = 4, instance: str = "draft-0", **times
) -> Span:
    """A draft worker's round: drafting k tokens from its start for draft_ms."""
    verify_ms, duration_ms = times.get("verify_ms", 0.0), times.get("duration_ms", draft_ms)
    attributes = {
        "specdec.k": k,
        "specdec.accepted": times.get("accepted", k),
        "specdec.committed": times.get("accepted", k) + 1,
        "specdec.draft_ns": round(draft_ms * MS),
        "specdec.verify_ns": round(verify_ms * MS),
        "specdec.target_compute_ns": 0,
    }
    start = round(start_ms * MS)
    end = start + round(duration_ms * MS)
    return Span(ROUND_SPAN, "d" * 32, "r" * 16, None, start, end, attributes, "draft", instance)


def test_the_target_fit_recovers_base_per_token_and_per_row():
    spans = step_spans(lambda tokens, rows: 8.0 + 0.5 * tokens + 1.5 * rows)
    target = target_pass_from_spans(spans)
    assert target.base_ms == pytest.approx(8.0, abs=0.4)
    assert target.per_token_ms == pytest.approx(0.5, abs=0.05)
    assert target.per_row_ms == pytest.approx(1.5, abs=0.15)
    assert target.prefill_token_ms is None
    assert "60 target steps" in target.source and "median |error|" in target.source


def test_each_step_counts_once_however_many_sessions_name_it():
    spans = step_spans(lambda tokens, rows: 8.0 + tokens, steps=5)
    assert sum(target_steps(spans).values()) == 5
    # two workers with the same step times: their steps apart
    other = step_spans(lambda tokens, rows: 8.0 + tokens, steps=5, instance="target-1")
    assert sum(target_steps(spans + other).values()) == 10


def test_a_negative_per_row_is_dropped_and_the_tokens_refitted():
    # more sessions for the same tokens cost less: per_row would come out below 0
    spans = step_spans(lambda tokens, rows: 10.0 + 1.0 * tokens - 0.5 * rows)
    target = target_pass_from_spans(spans)
    assert target.per_row_ms == 0.0
    assert target.per_token_ms > 0 and target.base_ms > 0
    # the tokens alone: the least-squares line of the steps over their tokens
    steps = {(s.attributes["specdec.batch_tokens"], s.attributes["specdec.step_ns"]) for s in spans}
    slope, intercept = statistics.linear_regression(*zip(*steps))
    assert target.per_token_ms == pytest.approx(slope / MS)
    assert target.base_ms == pytest.approx(intercept / MS)


def test_a_negative_base_is_refitted_through_the_origin():
    spans = step_spans(lambda tokens, rows: -2.0 + 1.0 * tokens + 2.0 * rows)
    target = target_pass_from_spans(spans)
    assert target.base_ms == 0.0
    assert target.per_token_ms > 0 and target.per_row_ms > 0
    assert target.pass_ms(4, 20) == pytest.approx(-2.0 + 20 + 8, rel=0.15)


def test_the_draft_batch_is_the_rounds_drafting_at_a_rounds_middle():
    spans = [
        round_span(0, 4),  # middle 2: itself and the second -> batch 2
        round_span(1, 4),  # middle 3: the first two -> 2
        round_span(10, 2),  # alone -> 1
        round_span(20, 8),  # middle 24: with the next three -> 4
        round_span(21, 6),  # middle 24 -> 4
        round_span(22, 4),  # middle 24 -> 4
        round_span(23, 2),  # middle 24 -> 4
        round_span(20, 1, k=0),  # drafted nothing: skipped, and not drafting
        round_span(20, 8, instance="draft-1"),  # another worker's: alone -> 1
    ]
    draft = draft_step_from_spans(spans)
    # batch 1: 2 ms / 4 and 8 ms / 4 -> 1.25 ms; batch 2: 1 ms; batches 3-4 at 4: 1.25 ms
    assert [batch for batch, _ in draft.ms_by_batch] == [1, 2, 4]
    assert [ms for _, ms in draft.ms_by_batch] == pytest.approx([1.25, 1.0, 1.25])
    assert "8 draft rounds on 2 draft worker(s)" in draft.source


def test_the_round_overhead_is_the_median_of_the_rounds_other_time():
    spans = [
        round_span(0, 2, verify_ms=5, duration_ms=7.5),  # 0.5
        round_span(10, 2, verify_ms=5, duration_ms=8),  # 1
        round_span(20, 2, verify_ms=5, duration_ms=10),  # 3
        round_span(30, 2, verify_ms=5, duration_ms=7),  # 0: not counted
    ]
    link = link_from_spans(spans, one_way_ms=2.5)
    assert link.round_overhead_ms == pytest.approx(1.0)
    assert link.one_way_ms == (2.5,)
    assert "3 rounds" in link.source


def trace_spans() -> list[Span]:
    """A run's spans: target steps of 8 ms + 0.5 ms a token + 1 ms a session (one span
    each), and rounds of k = 4 drafting 4 ms alone in 12 ms, 7 of them verifying, 3 tokens
    accepted in 4 of every 5."""
    steps = [
        Span(
            VERIFY_SPAN,
            "a" * 32,
            f"{i:016x}",
            None,
            i * 20 * MS,
            i * 20 * MS + MS,
            {
                "specdec.step_ns": round((8 + 0.5 * tokens + rows) * MS),
                "specdec.batch_tokens": tokens,
                "specdec.batch_sessions": rows,
            },
            "target",
        )
        for i, (tokens, rows) in enumerate((t, r) for t in (1, 4, 9, 16) for r in (1, 3))
    ]
    rounds = [
        round_span(i * 20, 4, verify_ms=7, duration_ms=12, accepted=3 if i % 5 else 0)
        for i in range(10)
    ]
    return steps + rounds


@pytest.fixture
def trace_file(tmp_path):
    """The spans as a worker's --trace-file writes them (service_common.telemetry.span_to_dict)."""
    path = tmp_path / "spans.jsonl"
    records = [
        {
            "name": s.name,
            "kind": "INTERNAL",
            "trace_id": s.trace_id,
            "span_id": s.span_id,
            "parent_span_id": s.parent_span_id,
            "start_ns": s.start_ns,
            "end_ns": s.end_ns,
            "status": "UNSET",
            "attributes": s.attributes,
            "resource": {"service.name": s.service, "service.instance.id": s.instance},
        }
        for s in trace_spans()
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_costs_from_traces_fills_every_group(trace_file):
    costs = costs_from_traces(
        [trace_file], one_way_ms=3.0, k_max=4, request=Request(16, 32), rate_per_s=5.0
    )
    assert costs.target.base_ms == pytest.approx(8.0)
    assert costs.target.per_token_ms == pytest.approx(0.5)
    assert costs.target.per_row_ms == pytest.approx(1.0)
    assert costs.draft.ms_by_batch == ((1, pytest.approx(1.0)),)
    assert costs.acceptance("measured").by_position == pytest.approx((0.8, 1.0, 1.0, 0.0))
    assert costs.link.round_overhead_ms == pytest.approx(1.0)
    assert costs.link.one_way_ms == (3.0,)
    assert costs.arrivals.rate_per_s == 5.0


def test_the_planner_runs_on_traces_and_leaves_the_costs_behind(trace_file, tmp_path, capsys):
    written = tmp_path / "costs.json"
    quick = ["--requests", "20", "--steps", "1", "--ks", "2", "--ratios", "1:1", "--jobs", "1"]
    argv = ["--traces", str(trace_file), "--one-way-ms", "2", "--prompt-tokens", "8"]
    assert main([*argv, "--new-tokens", "16", "--write-costs", str(written), *quick]) == 0
    out = capsys.readouterr().out
    assert "## Plan" in out and "target steps (traces)" in out
    costs = Costs.load(written)
    assert costs.target.base_ms == pytest.approx(8.0)
    assert costs.request.new_tokens == 16 and costs.link.one_way_ms == (2.0,)


@pytest.mark.parametrize(
    "argv",
    [
        [],  # neither
        ["costs.json", "--traces", "spans.jsonl"],  # both
        ["--traces", "spans.jsonl", "--one-way-ms", "1"],  # the request's shape missing
        ["costs.json", "--one-way-ms", "1"],  # a --traces option without --traces
    ],
)
def test_costs_or_traces_exactly_one_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "--traces" in capsys.readouterr().err


def prefill_span(service: str, tokens: int, prefill_ms: float, wait_ms: float = 0.0) -> Span:
    attributes = {"specdec.tokens": tokens, "specdec.prefill_ns": round(prefill_ms * MS)}
    end = round((prefill_ms + wait_ms) * MS)  # the span holds the admission wait too
    return Span(PREFILL_SPAN, "t" * 32, "p" * 16, None, 0, end, attributes, service, "w-0")


def test_a_prompt_token_costs_the_prefill_less_the_base_over_its_tokens():
    """Base 8 ms and 0.5 ms a token in the steps; quiet prefills at 2 ms a prompt token
    after the base, their admission waits apart, busy ones (beside steps) slower; a draft
    worker's prefills do not count."""
    spans = step_spans(lambda tokens, sessions: 8 + 0.5 * tokens)
    spans += [prefill_span("target", n, 8 + 2 * n, wait_ms=50) for n in (10, 40, 90)]
    spans += [prefill_span("target", n, 8 + 9 * n) for n in (20, 30, 50, 60, 70, 80, 95)]
    spans += [prefill_span("draft", 40, 500)]
    assert target_pass_from_spans(spans).prefill_token_ms == pytest.approx(2.0, rel=0.05)
    assert target_pass_from_spans(step_spans(lambda t, s: 8 + t)).prefill_token_ms is None


def test_a_batch_of_a_few_rounds_is_left_out_of_the_draft_table():
    """200 rounds alone at 20 ms a step, 3 overlapping at 1 ms: the 3 are noise."""
    spans = [round_span(100.0 * i, 80.0) for i in range(200)]
    spans += [round_span(50_000.0, 4.0), round_span(50_001.0, 4.0), round_span(50_002.0, 4.0)]
    assert draft_step_from_spans(spans).ms_by_batch == ((1, pytest.approx(20.0)),)
