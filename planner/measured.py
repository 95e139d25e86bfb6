"""The fleet model's costs from a running system's traces (the services' JSON-lines
span files, `--trace-exporter jsonl --trace-file PATH`), in place of a hand-written file.

What each input is fitted from:
- `target`: the target worker's steps, as its specdec.verify and specdec.decode spans
  carry them (specdec.step_ns over specdec.batch_tokens and specdec.batch_sessions, each
  step once however many sessions' spans name it): least squares of
  step = base + per_token T + per_row R, no coefficient below 0. T counts prompt tokens
  too (the step's tokens run through the model), so prefill is a token like any other.
- `draft`: the draft workers' round spans: draft_ns / k a step, by how many rounds the
  same draft worker was drafting at once (at the middle of the round's drafting).
- `workloads`: acceptance by position from the same rounds (`acceptance_from_rounds`).
- `link`: the round's time besides drafting and verifying (the draft's host work); the
  one-way delay is the caller's (an emulated delay is known, a real one is not in spans).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from foundation.pass_cost import Moments, PassCost, fit_pass_cost
from planner.costs import (
    NS_PER_MS,
    Acceptance,
    Arrivals,
    Costs,
    DraftStep,
    Link,
    Request,
    TargetPass,
    acceptance_from_rounds,
)
from report.traces import (
    DECODE_SPAN,
    PREFILL_SPAN,
    ROUND_SPAN,
    VERIFY_SPAN,
    Span,
    read_spans,
    rounds_of,
)

# Draft rounds a batch size needs to be in the step table (of a few hundred or more).
MIN_ROUNDS_A_BUCKET = 10

# (worker, step_ns, batch_tokens, batch_sessions): the spans of one target step
StepKey = tuple[str, int, int, int]


def costs_from_traces(
    paths: Sequence[str | Path],
    *,
    one_way_ms: float,
    local_one_way_ms: float | None = None,
    k_max: int = 8,
    request: Request,
    rate_per_s: float = 0.0,
    workload: str = "measured",
    max_sessions: int | None = None,
) -> Costs:
    """The costs of the traces' run: the target's pass, the draft's step, the acceptance
    (as `workload`) and the round overhead fitted from the spans; the link's delay, the
    request and the arrival rate as given. max_sessions: the target's session cap (None:
    TargetPass's default; the traces show how many sessions ran, not how many fit)."""
    spans = read_spans(paths)
    target = target_pass_from_spans(spans)
    if max_sessions is not None:
        target = dataclasses.replace(target, max_sessions=max_sessions)
    rounds = rounds_of(spans)
    return Costs(
        target=target,
        draft=draft_step_from_spans(spans),
        workloads={
            workload: Acceptance(
                acceptance_from_rounds(((r.k, r.accepted) for r in rounds), k_max),
                f"{len(rounds)} rounds (traces)",
            )
        },
        link=link_from_spans(spans, one_way_ms, local_one_way_ms),
        arrivals=Arrivals(rate_per_s, "given" if rate_per_s else "none given"),
        request=request,
        notes=f"from traces: {', '.join(str(p) for p in paths)}",
    )


# --- the target's pass --------------------------------------------------------------------


def target_pass_from_spans(spans: Sequence[Span]) -> TargetPass:
    """step_ms = base + per_token x batch_tokens + per_row x batch_sessions, least squares
    over the target's steps, each counted once; a coefficient that comes out below 0 is
    dropped and the rest refitted. ValueError where the spans hold no step."""
    steps = target_steps(spans)
    if not steps:
        raise ValueError(
            f"no target steps in the traces ({VERIFY_SPAN} / {DECODE_SPAN} spans with "
            "specdec.step_ns)"
        )
    weights = list(steps.values())
    step_ns = [float(ns) for _, ns, _, _ in steps]
    tokens, rows = [float(t) for _, _, t, _ in steps], [float(r) for _, _, _, r in steps]
    # the fit's second variable (p, prefill tokens elsewhere) is the rows here
    cost = fit_nonnegative(Moments.of(tokens, step_ns, rows, weights))
    errors = [
        abs(cost.ns(t, r) - ns) / ns
        for (_, ns, t, r), weight in steps.items()
        for _ in range(weight)
    ]
    base_ms = cost.base_ns / NS_PER_MS
    return TargetPass(
        base_ms=base_ms,
        per_token_ms=cost.per_token_ns / NS_PER_MS,
        per_row_ms=cost.per_prefill_token_ns / NS_PER_MS,
        prefill_token_ms=prefill_token_ms(spans, "target", base_ms),
        source=f"fit over {sum(weights)} target steps (traces), median |error| "
        f"{statistics.median(errors):.1%}; a prompt token from the prefill spans",
    )


def prefill_token_ms(spans: Iterable[Span], service: str, base_ms: float) -> float | None:
    """A prompt token's ms: over the service's prefill spans, their time (less the pass's
    base) a token, the lowest decile: a prefill runs beside the worker's steps, on the same
    cores, and the busy ones measure the steps too. None without such spans."""
    per_token = [
        (_prefill_ns(s) / NS_PER_MS - base_ms) / int(s.attributes["specdec.tokens"])
        for s in spans
        if s.name == PREFILL_SPAN
        and s.service == service
        and int(s.attributes.get("specdec.tokens", 0)) > 0
    ]
    if not per_token:
        return None
    return max(0.0, sorted(per_token)[len(per_token) // 10])


def _prefill_ns(span: Span) -> int:
    """The prefill's own time where the span says it (its admission wait apart)."""
    return int(span.attributes.get("specdec.prefill_ns", span.end_ns - span.start_ns))


def target_steps(spans: Iterable[Span]) -> dict[StepKey, int]:
    """The target's steps in its verify and decode spans, and how many steps each key
    stands for: a step's sessions each carry it (the same step_ns and batch), so the
    spans of a key over its batch_sessions, at least one (identical steps share a key)."""
    spans_of: Counter[StepKey] = Counter()
    for span in spans:
        a = span.attributes
        if span.name in (VERIFY_SPAN, DECODE_SPAN) and int(a.get("specdec.step_ns", 0)) > 0:
            rows = max(1, int(a.get("specdec.batch_sessions", 1)))
            spans_of[
                span.instance, int(a["specdec.step_ns"]), int(a["specdec.batch_tokens"]), rows
            ] += 1
    return {key: math.ceil(count / key[3]) for key, count in spans_of.items()}


def fit_nonnegative(m: Moments) -> PassCost:
    """`fit_pass_cost` over x (tokens) and p (rows), each coefficient >= 0: a slope the fit
    puts below 0 is dropped and the other refitted alone (x's by fit_pass_cost itself, p's
    here); a base below 0, the line refitted through the origin."""
    cost = _slopes_nonnegative(m)
    if cost.base_ns >= 0:
        return cost
    return _slopes_nonnegative(_about_zero(m))._replace(base_ns=0.0)


def _slopes_nonnegative(m: Moments) -> PassCost:
    cost = fit_pass_cost(m)
    if cost.per_prefill_token_ns > 0 or not m.var_p:
        return cost
    # p's slope clamped at 0: x's is refitted without p
    return fit_pass_cost(dataclasses.replace(m, mean_p=0.0, var_p=0.0, cov_xp=0.0, cov_pc=0.0))


def _about_zero(m: Moments) -> Moments:
    """The moments about 0 (E[xy] for the covariances, means 0): least squares through
    the origin, no base."""
    return Moments(
        mean_x=0.0,
        mean_c=0.0,
        var_x=m.var_x + m.mean_x**2,
        cov_xc=m.cov_xc + m.mean_x * m.mean_c,
        var_p=m.var_p + m.mean_p**2,
        cov_xp=m.cov_xp + m.mean_x * m.mean_p,
        cov_pc=m.cov_pc + m.mean_p * m.mean_c,
    )


# --- the draft's step ---------------------------------------------------------------------


def draft_step_from_spans(spans: Sequence[Span]) -> DraftStep:
    """ms a draft step by batch: a round of k drafted tokens took draft_ns / k a step, at
    the batch of rounds its draft worker was drafting at the middle of its drafting
    (itself counted). Batches in buckets 1, 2, 3-4, 5-8, ... at their mean batch, the mean
    step of each. Rounds of k = 0 drafted nothing: skipped. ValueError where none drafted."""
    by_worker: defaultdict[str, list[Span]] = defaultdict(list)
    for span in spans:
        if span.name == ROUND_SPAN and int(span.attributes["specdec.k"]) > 0:
            by_worker[span.instance].append(span)
    if not by_worker:
        raise ValueError(f"no draft rounds in the traces ({ROUND_SPAN} spans with k > 0)")
    buckets: defaultdict[int, list[tuple[int, float]]] = defaultdict(list)
    for rounds in by_worker.values():
        for batch, step_ms in _steps_by_batch(rounds):
            buckets[(batch - 1).bit_length()].append((batch, step_ms))
    # a bucket of a few rounds is noise (an adaptive call drafts rarely under load)
    least = min(MIN_ROUNDS_A_BUCKET, sum(len(rows) for rows in buckets.values()) // 10)
    kept = {b: rows for b, rows in buckets.items() if len(rows) >= least}
    kept = kept or dict([max(buckets.items(), key=lambda item: len(item[1]))])
    table = tuple(
        (round(statistics.mean(b for b, _ in rows)), statistics.mean(ms for _, ms in rows))
        for _, rows in sorted(kept.items())
    )
    rounds = sum(len(r) for r in by_worker.values())
    return DraftStep(
        ms_by_batch=table,
        prefill_token_ms=prefill_token_ms(spans, "draft", table[0][1]) or 0.0,
        source=f"{rounds} draft rounds on {len(by_worker)} draft worker(s) (traces): "
        "draft_ns / k by rounds drafting at once; a prompt token from the prefill spans",
    )


def _steps_by_batch(rounds: Sequence[Span]) -> list[tuple[int, float]]:
    """(rounds drafting at the middle of each one's drafting, its ms a step), one worker's."""
    intervals = [(s.start_ns, s.start_ns + int(s.attributes["specdec.draft_ns"])) for s in rounds]
    starts, ends = sorted(a for a, _ in intervals), sorted(b for _, b in intervals)
    steps = []
    for span, (start, end) in zip(rounds, intervals):
        middle = (start + end) / 2
        # started by the middle, less those already done before it (each ends after it starts)
        batch = bisect.bisect_right(starts, middle) - bisect.bisect_left(ends, middle)
        steps.append((batch, (end - start) / int(span.attributes["specdec.k"]) / NS_PER_MS))
    return steps


# --- the link ----------------------------------------------------------------------------


def link_from_spans(
    spans: Sequence[Span], one_way_ms: float, local_one_way_ms: float | None = None
) -> Link:
    """The round overhead: the median over rounds of their time besides drafting and
    verifying (where above 0: the draft's host work); the one-way delay as given; the
    local one (None: half the median transport, a round's verify less the target's whole
    handling of it, so the traces' link must be the local one)."""
    rounds = rounds_of(spans)
    others = [
        r.duration_ns - r.draft_ns - r.verify_ns
        for r in rounds
        if r.duration_ns > r.draft_ns + r.verify_ns
    ]
    overhead = statistics.median(others) / NS_PER_MS if others else 0.0
    if local_one_way_ms is None:
        transport = [r.verify_ns - r.target_handled_ns for r in rounds if r.target_handled_ns]
        local_one_way_ms = statistics.median(transport) / 2 / NS_PER_MS if transport else 0.0
    return Link(
        one_way_ms=(one_way_ms,),
        local_one_way_ms=max(0.0, local_one_way_ms),
        round_overhead_ms=overhead,
        source=f"one-way given; round overhead the median of {len(others)} rounds, local "
        f"one-way half their median transport (traces)",
    )
