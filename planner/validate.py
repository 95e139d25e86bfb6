"""The fleet model against a measurement: the same layout, rates and arrivals, cell by cell.

A measurement (benchmarks/bench_capacity.py) gives, per layout and offered rate, what the
model gives (`fleet.Result`): output tokens/s a target, TPOT p50 and p90, TTFT p90 and
the mean queue. Here the model runs on the same Poisson arrivals (`fleet.poisson_arrivals`,
the same seeds), and each cell is judged: below saturation (at least SERVED of the offered
tokens served) the model must be within BELOW_TOLERANCE on tokens/s and TPOT p50 and p90;
past it, within OVER_TOLERANCE on tokens/s (what a saturated target serves).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from planner import fleet
from planner.costs import Costs

SERVED = 0.9  # of the offered tokens: below this a cell is past saturation
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

    def served(self, new_tokens: int) -> bool:
        """Below saturation: it served at least SERVED of the tokens offered."""
        return self.tokens_per_s >= SERVED * self.rate_per_s * new_tokens


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
            rate, r.tokens_per_s, r.tpot_p50_ms, r.tpot_p90_ms, r.ttft_p90_ms, r.mean_queue
        )
    return out


def goodput(points: dict[float, Point], new_tokens: int, bound_ms: float) -> float:
    """The highest rate served with TPOT p90 within bound_ms (0: none)."""
    return max(
        (r for r, p in points.items() if p.served(new_tokens) and p.tpot_p90_ms <= bound_ms),
        default=0.0,
    )


def errors(measured: Point, model: Point, new_tokens: int) -> dict[str, float]:
    """The model's relative errors on what the cell is judged by."""
    names = ("tokens_per_s", "tpot_p50_ms", "tpot_p90_ms")
    names = names if measured.served(new_tokens) else names[:1]
    return {n: _relative(getattr(measured, n), getattr(model, n)) for n in names}


def within(measured: Point, model: Point, new_tokens: int) -> bool:
    tolerance = BELOW_TOLERANCE if measured.served(new_tokens) else OVER_TOLERANCE
    return all(abs(e) <= tolerance for e in errors(measured, model, new_tokens).values())


def table(measured: dict[float, Point], model: dict[float, Point], new_tokens: int) -> list[str]:
    """Markdown rows: each rate's measured / modelled values and the model's error; the
    queue measured only (a measurement's counts calls waiting for a step too, the model's
    only those waiting for a slot)."""
    lines = [
        "| req/s | tok/s | TPOT p50 ms | TPOT p90 ms | TTFT p90 ms | mean queue, measured "
        "| within |",
        "|---|---|---|---|---|---|---|",
    ]
    for rate, m in measured.items():
        x = model[rate]
        cells = [_pair(getattr(m, n), getattr(x, n)) for n in ("tokens_per_s", "tpot_p50_ms")]
        cells += [_pair(getattr(m, n), getattr(x, n)) for n in ("tpot_p90_ms", "ttft_p90_ms")]
        state = "" if m.served(new_tokens) else " (past saturation)"
        verdict = "yes" if within(m, x, new_tokens) else "no"
        lines.append(f"| {rate:g}{state} | {' | '.join(cells)} | {m.mean_queue:.2f} | {verdict} |")
    return lines


def verdict(cells: list[tuple[Point, Point]], new_tokens: int) -> str:
    """How many cells the model meets, below and past saturation."""
    below = [within(m, x, new_tokens) for m, x in cells if m.served(new_tokens)]
    over = [within(m, x, new_tokens) for m, x in cells if not m.served(new_tokens)]
    return (
        f"{sum(below)} of {len(below)} cells below saturation within "
        f"{BELOW_TOLERANCE:.0%} (tok/s, TPOT p50 and p90); {sum(over)} of {len(over)} past "
        f"saturation within {OVER_TOLERANCE:.0%} (tok/s)"
    )


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
