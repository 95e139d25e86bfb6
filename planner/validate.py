"""The fleet model against a measurement: the same layout, rates and arrivals, cell by cell.

A measurement (benchmarks/bench_capacity.py) gives, per layout and offered rate, what the
model gives (`fleet.Result`): output tokens/s a target, TPOT p50 and p90, TTFT p90, the
mean queue, and the tokens served while busy. Here the model runs on the same Poisson
arrivals (`fleet.poisson_arrivals`, the same seeds). A layout's **saturation** is what
it serves while busy at its highest rate, where that rate outruns it (it served less
than SERVED of the tokens offered); a cell is **below saturation** where its offered
tokens are under SERVED of that. Judged: below saturation, the model within
BELOW_TOLERANCE on tokens/s and TPOT p50 and p90 of every cell; the saturation within
OVER_TOLERANCE.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from planner import fleet
from planner.costs import Costs

SERVED = 0.9  # of the offered tokens: a rate served less outruns the layout
BELOW_TOLERANCE = 0.10
OVER_TOLERANCE = 0.15


@dataclass(frozen=True)
class Point:
    """One layout at one offered rate, measured or modelled (per target worker; ms)."""

    rate_per_s: float
    tokens_per_s: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    ttft_p90_ms: float
    mean_queue: float
    busy_tokens_per_s: float  # every request's tokens, first arrival to last token

    def offered(self, new_tokens: int) -> float:
        return self.rate_per_s * new_tokens


def saturation(points: dict[float, Point], new_tokens: int) -> float | None:
    """What the layout serves while busy at its highest rate, where that rate outruns it;
    None where no rate did (every cell is then below saturation)."""
    top = points[max(points)]
    return (
        top.busy_tokens_per_s if top.busy_tokens_per_s < SERVED * top.offered(new_tokens) else None
    )


def below(point: Point, capacity: float | None, new_tokens: int) -> bool:
    """Offered under SERVED of the layout's saturation."""
    return capacity is None or point.offered(new_tokens) < SERVED * capacity


def modelled(
    costs: Costs,
    cell: fleet.Cell,
    setting: fleet.Speculation,
    rates: list[float],
    requests: int,
    warmup: float,
    seed: int,
) -> dict[float, Point]:
    """The model at each rate, the i-th on the arrivals of seed + i (as measured)."""
    out = {}
    for turn, rate in enumerate(rates):
        r = fleet.simulate(
            costs, cell, setting, rate, requests=requests, warmup=warmup, seed=seed + turn
        )
        out[rate] = Point(
            rate,
            r.tokens_per_s,
            r.tpot_p50_ms,
            r.tpot_p90_ms,
            r.ttft_p90_ms,
            r.mean_queue,
            r.busy_tokens_per_s,
        )
    return out


def goodput(points: dict[float, Point], new_tokens: int, bound_ms: float) -> float:
    """The highest rate below saturation with TPOT p90 within bound_ms (0: none)."""
    capacity = saturation(points, new_tokens)
    return max(
        (
            r
            for r, p in points.items()
            if below(p, capacity, new_tokens) and p.tpot_p90_ms <= bound_ms
        ),
        default=0.0,
    )


NAMES = ("tokens_per_s", "tpot_p50_ms", "tpot_p90_ms")  # what a cell below saturation is judged by


def judged(
    measured: dict[float, Point], model: dict[float, Point], new_tokens: int
) -> list[tuple[str, float, bool]]:
    """(what, the model's relative error, within its tolerance) of a layout: each measure
    of each cell below saturation, then the saturation where measured."""
    capacity = saturation(measured, new_tokens)
    out = []
    for rate, m in measured.items():
        if below(m, capacity, new_tokens):
            out += [(f"{rate:g}/s {n}", e, ok) for n, e, ok in _cell(m, model[rate])]
    if capacity is not None:
        error = _relative(capacity, model[max(model)].busy_tokens_per_s)
        out.append(("saturation", error, abs(error) <= OVER_TOLERANCE))
    return out


def table(measured: dict[float, Point], model: dict[float, Point], new_tokens: int) -> list[str]:
    """Markdown rows: each rate's measured / modelled values and the model's error (the
    queue measured only: a measurement's counts calls waiting for a step too, the
    model's only those waiting for a slot), then the saturation."""
    capacity = saturation(measured, new_tokens)
    lines = [
        "| req/s | tok/s | TPOT p50 ms | TPOT p90 ms | TTFT p90 ms | mean queue, measured "
        "| within |",
        "|---|---|---|---|---|---|---|",
    ]
    for rate, m in measured.items():
        x = model[rate]
        cells = [_pair(getattr(m, n), getattr(x, n)) for n in (*NAMES, "ttft_p90_ms")]
        judged_text = "past saturation"
        if below(m, capacity, new_tokens):
            judged_text = "yes" if all(ok for _, _, ok in _cell(m, x)) else "no"
        lines.append(f"| {rate:g} | {' | '.join(cells)} | {m.mean_queue:.2f} | {judged_text} |")
    top = model[max(model)].busy_tokens_per_s
    seen = "not reached" if capacity is None else _pair(capacity, top)
    return lines + ["", f"Saturation (tok/s served while busy, at {max(measured):g}/s): {seen}."]


def verdict(layouts: list[tuple[dict[float, Point], dict[float, Point]]], new_tokens: int) -> str:
    """How many judged values the model meets, below saturation and at it."""
    values = [v for measured, model in layouts for v in judged(measured, model, new_tokens)]
    cells = [ok for what, _, ok in values if what != "saturation"]
    tops = [ok for what, _, ok in values if what == "saturation"]
    return (
        f"{sum(cells)} of {len(cells)} measures below saturation within "
        f"{BELOW_TOLERANCE:.0%} (tok/s, TPOT p50 and p90 of each cell); {sum(tops)} of "
        f"{len(tops)} saturations within {OVER_TOLERANCE:.0%}"
    )


def _cell(measured: Point, model: Point) -> list[tuple[str, float, bool]]:
    """(measure, the model's relative error, within BELOW_TOLERANCE) of a cell below
    saturation."""
    errors = [(n, _relative(getattr(measured, n), getattr(model, n))) for n in NAMES]
    return [(n, e, abs(e) <= BELOW_TOLERANCE) for n, e in errors]


def _relative(measured: float, model: float) -> float:
    return (model - measured) / measured if measured else float("inf")


def _pair(measured: float, model: float) -> str:
    """'measured / model (error)'."""
    error = _relative(measured, model)
    shown = f"{error:+.0%}" if abs(error) != float("inf") else "-"
    return f"{measured:.1f} / {model:.1f} ({shown})"


def plot(
    results: dict[str, tuple[dict[float, Point], dict[float, Point]]], path: str | Path
) -> Path:
    """A PNG of tokens/s and TPOT p90 against the offered rate, per layout: measured
    (points, solid) beside the model (dashed), in the layout's colour."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, (served, tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, (label, (measured, model)) in enumerate(results.items()):
        colour = f"C{index}"
        rates = sorted(measured)
        for axes, name in ((served, "tokens_per_s"), (tpot, "tpot_p90_ms")):
            got = [getattr(measured[r], name) for r in rates]
            axes.plot(rates, got, "o-", color=colour, label=f"{label}, measured")
            axes.plot(rates, [getattr(model[r], name) for r in rates], "--", color=colour)
    served.set(xlabel="offered requests/s", ylabel="output tokens/s a target core")
    tpot.set(xlabel="offered requests/s", ylabel="TPOT p90 (ms)", yscale="log")
    served.legend(fontsize=7, title="dashed: the fleet model", title_fontsize=7)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
