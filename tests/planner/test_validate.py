"""planner/validate.py: the model against a measurement, cell by cell: a layout's
saturation, which cells are below it, what counts as within, goodput, and the model run
on the measured arrivals."""

from __future__ import annotations

import pytest

from planner import fleet
from planner.validate import (
    Point,
    below,
    goodput,
    judged,
    modelled,
    plot,
    saturation,
    table,
    verdict,
)

NEW = 32  # tokens a request


def point(rate: float, tokens_per_s: float, p50=50.0, p90=80.0, busy: float | None = None):
    return Point(rate, tokens_per_s, p50, p90, 500.0, 0.1, tokens_per_s if busy is None else busy)


def layout(top_busy: float) -> dict[float, Point]:
    """Rates 1, 2, 4 a second; what the top rate serves while busy is top_busy."""
    return {1.0: point(1.0, 32.0), 2.0: point(2.0, 64.0), 4.0: point(4.0, 90.0, busy=top_busy)}


def test_saturation_is_what_the_top_rate_serves_where_it_outruns_the_layout():
    assert saturation(layout(100.0), NEW) == 100.0  # 128 tokens/s offered, 100 served
    assert saturation(layout(120.0), NEW) is None  # 120 >= 0.9 x 128: never outrun


def test_a_cell_is_below_saturation_under_90_percent_of_it():
    assert below(point(2.0, 64.0), 100.0, NEW)  # 64 offered < 90
    assert not below(point(3.0, 64.0), 100.0, NEW)  # 96 offered
    assert below(point(3.0, 64.0), None, NEW)  # no saturation seen: every cell is below


def test_below_saturation_each_measure_is_judged_within_10_percent_and_saturation_15():
    measured = layout(100.0)
    model = {
        1.0: point(1.0, 32.0 * 1.09, 54.0, 72.5),  # all within 10%
        2.0: point(2.0, 64.0, 50.0, 89.0),  # p90 11% high
        4.0: point(4.0, 10.0, 900.0, 900.0, busy=114.0),  # past: only the saturation
    }
    values = {what: ok for what, _, ok in judged(measured, model, NEW)}
    assert values == {
        "1/s tokens_per_s": True,
        "1/s tpot_p50_ms": True,
        "1/s tpot_p90_ms": True,
        "2/s tokens_per_s": True,
        "2/s tpot_p50_ms": True,
        "2/s tpot_p90_ms": False,
        "saturation": True,
    }
    model[4.0] = point(4.0, 10.0, busy=116.0)
    assert not dict((w, ok) for w, _, ok in judged(measured, model, NEW))["saturation"]
    assert verdict([(measured, model)], NEW).startswith("5 of 6 measures below saturation")


def test_goodput_is_the_highest_rate_below_saturation_within_the_bound():
    points = layout(100.0) | {3.0: point(3.0, 80.0, p90=60.0)}  # 96 offered: past 90
    assert goodput(points, NEW, bound_ms=100.0) == 2.0
    assert goodput(points, NEW, bound_ms=50.0) == 0.0


def test_the_model_runs_on_the_seeded_arrivals_of_each_rate(make_costs):
    """The i-th rate on seed + i: the same point as fleet.simulate with that seed; a rate
    far past what one target serves is what it serves while busy."""
    costs = make_costs()
    cell, setting = fleet.Cell(fleet.Layout.TARGET_ONLY), fleet.TARGET_ONLY
    points = modelled(costs, cell, setting, [1.0, 400.0], requests=60, warmup=0.2, seed=3)
    alone = fleet.simulate(costs, cell, setting, 400.0, requests=60, warmup=0.2, seed=4)
    assert points[400.0].tokens_per_s == pytest.approx(alone.tokens_per_s)
    assert saturation(points, costs.request.new_tokens) == alone.busy_tokens_per_s > 0


def test_table_marks_each_cell_and_the_saturation(tmp_path):
    measured, model = layout(100.0), layout(130.0)
    model[1.0] = point(1.0, 32.0 * 1.2)
    rows = table(measured, model, NEW)
    assert rows[2].startswith("| 1 | 32.0 / 38.4 (+20%)") and rows[2].endswith("| no |")
    assert rows[3].endswith("| yes |") and rows[4].endswith("| past saturation |")
    assert rows[-1] == "Saturation (tok/s served while busy, at 4/s): 100.0 / 130.0 (+30%)."
    assert plot({"target-only": (measured, model)}, tmp_path / "c.png").stat().st_size > 1000
