"""planner/validate.py: the model against a measurement, cell by cell: when a cell is past
saturation, what counts as within, goodput, and the model run on the measured arrivals."""

from __future__ import annotations

import pytest

from planner import fleet
from planner.validate import (
    Point,
    errors,
    goodput,
    modelled,
    plot,
    table,
    verdict,
    within,
)

NEW = 32  # tokens a request


def point(rate: float, tokens_per_s: float, p50: float = 50.0, p90: float = 80.0) -> Point:
    return Point(rate, tokens_per_s, p50, p90, 500.0, 0.1)


def test_a_cell_is_past_saturation_below_90_percent_of_the_tokens_offered():
    assert point(1.0, 0.9 * NEW).served(NEW)
    assert not point(1.0, 0.89 * NEW).served(NEW)


def test_below_saturation_every_measure_must_be_within_10_percent():
    measured = point(1.0, NEW)
    assert within(measured, point(1.0, NEW * 1.09, 54.0, 72.5), NEW)
    assert not within(measured, point(1.0, NEW, 50.0, 89.0), NEW)  # p90 11% high
    assert not within(measured, point(1.0, NEW * 0.89), NEW)
    assert errors(measured, point(1.0, NEW, 55.0, 80.0), NEW)["tpot_p50_ms"] == pytest.approx(0.1)


def test_past_saturation_only_throughput_counts_within_15_percent():
    measured = point(4.0, 60.0, 300.0, 900.0)
    assert not measured.served(NEW)
    assert within(measured, point(4.0, 68.0, 100.0, 100.0), NEW)  # latencies not judged
    assert not within(measured, point(4.0, 70.0), NEW)
    assert set(errors(measured, point(4.0, 70.0), NEW)) == {"tokens_per_s"}


def test_goodput_is_the_highest_rate_served_within_the_bound():
    points = {
        0.5: point(0.5, 16.0, p90=60.0),
        1.0: point(1.0, 32.0, p90=95.0),
        2.0: point(2.0, 64.0, p90=130.0),  # over the bound
        3.0: point(3.0, 40.0, p90=90.0),  # past saturation, however quick
    }
    assert goodput(points, NEW, bound_ms=100.0) == 1.0
    assert goodput(points, NEW, bound_ms=50.0) == 0.0


def test_the_model_runs_on_the_seeded_arrivals_of_each_rate(make_costs):
    """The i-th rate on seed + i: the same points as fleet.simulate with that seed, and a
    rate far past what one target serves comes out past saturation."""
    costs = make_costs()
    cell, setting = fleet.Cell(fleet.Layout.TARGET_ONLY), fleet.TARGET_ONLY
    points = modelled(costs, cell, setting, [1.0, 400.0], requests=60, warmup=0.2, seed=3)
    alone = fleet.simulate(costs, cell, setting, 400.0, requests=60, warmup=0.2, seed=4)
    assert points[400.0].tokens_per_s == pytest.approx(alone.tokens_per_s)
    assert points[1.0].served(costs.request.new_tokens)
    assert not points[400.0].served(costs.request.new_tokens)


def test_table_and_verdict_count_cells_by_their_state(tmp_path):
    measured = {1.0: point(1.0, NEW), 4.0: point(4.0, 60.0)}
    model = {1.0: point(1.0, NEW * 1.2), 4.0: point(4.0, 62.0)}
    rows = table(measured, model, NEW)
    assert rows[2].startswith("| 1 | 32.0 / 38.4 (+20%)") and rows[2].endswith("| no |")
    assert rows[3].startswith("| 4 (past saturation) |") and rows[3].endswith("| yes |")
    cells = [(measured[r], model[r]) for r in measured]
    assert verdict(cells, NEW).startswith("0 of 1 cells below saturation")
    assert "1 of 1 past saturation" in verdict(cells, NEW)
    assert plot({"target-only": (measured, model)}, tmp_path / "c.png").stat().st_size > 1000
