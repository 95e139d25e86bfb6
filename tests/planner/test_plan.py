"""The planner picks what a costs file makes the better configuration by construction."""

from __future__ import annotations

import math

import pytest

from planner.fleet import Cell, Layout, Result, Speculation
from planner.plan import (
    Evaluation,
    Objective,
    Search,
    _highest,
    drafts_for,
    make_plan,
    targets_needed,
)

QUICK = Search(requests=40, steps=2, ks=(2,), ratios=((1, 2), (1, 1)))
TOKENS = Objective("tokens-per-s")


def test_objectives_parse():
    assert Objective.parse("tpot-p90-ms=50") == Objective("tpot-p90-ms", 50.0)
    assert Objective.parse("ttft-p90-ms=2.5").bound_ms == 2.5
    assert Objective.parse("tokens-per-s") == TOKENS
    for wrong in ("tpot-p90-ms", "tokens-per-s=3", "latency=4"):
        with pytest.raises(ValueError, match="objective"):
            Objective.parse(wrong)


def result(tpot_p90_ms: float = 0.0) -> Result:
    return Result(1.0, 0, 0, tpot_p90_ms, 0, 0, 1, 0, 0, 0, 0, 1)


def test_the_highest_rate_is_found_by_bisection():
    def run(rate: float) -> Result:
        return result(tpot_p90_ms=rate)

    rate, found = _highest(run, lambda r: r.tpot_p90_ms <= 30.0, top=100.0, steps=8, floor=0.1)
    assert 29.0 < rate <= 30.0 and found.tpot_p90_ms == rate
    assert _highest(run, lambda r: False, 100.0, 8, 0.1) == (0.0, None)
    assert _highest(run, lambda r: True, 100.0, 8, 0.1)[0] == 100.0


def test_no_draft_where_no_draft_token_is_accepted(make_costs):
    costs = make_costs(acceptance=(0.0,) * 3, draft={"ms_by_batch": ((1, 5.0),)})
    plan = make_plan(costs, TOKENS, QUICK)
    assert plan.chosen.cell.layout is Layout.TARGET_ONLY
    assert plan.chosen is plan.target_only
    assert plan.break_even_delay_ms is None  # a remote draft never pays


def test_a_free_co_located_draft_beats_a_distant_pool(make_costs):
    # A memory-bound target (a pass costs its base whatever its width): every draft token
    # accepted and free, the longest rounds win, on the target's own device.
    costs = make_costs(
        acceptance=(1.0,) * 4,
        target={"per_token_ms": 0.0},
        draft={"ms_by_batch": ((1, 0.0),)},
        link={"one_way_ms": (50.0,)},
    )
    search = Search(requests=40, steps=2, ks=(2, 4), ratios=((1, 1),))
    plan = make_plan(costs, Objective.parse("tpot-p90-ms=20"), search)
    assert plan.chosen.cell.layout is Layout.COLOCATED
    assert plan.chosen.speculation.k in (None, 4)
    assert plan.chosen.goodput_per_s > 1.5 * plan.target_only.goodput_per_s


def test_a_cheap_draft_pool_pays_until_its_link_is_too_slow(make_costs):
    costs = make_costs(
        acceptance=(0.9,) * 4,
        # drafting on the target's device is slow; a draft worker's step is cheap at any batch
        draft={"ms_by_batch": ((1, 0.5),), "colocated_ms_by_batch": ((1, 6.0),)},
        link={"one_way_ms": (0.1,)},
    )
    search = Search(requests=40, steps=3, ks=(2,), ratios=((1, 2), (1, 1)), tolerance=0.1)
    plan = make_plan(costs, TOKENS, search)
    assert plan.chosen.cell.layout is Layout.REMOTE
    assert plan.chosen.cell.ratio == 0.5  # one cheap draft worker serves two targets
    assert 0.1 < plan.break_even_delay_ms < math.inf


def test_fleet_arithmetic():
    assert targets_needed(100.0, 30.0) == 4 and targets_needed(1.0, 30.0) == 1
    assert targets_needed(5.0, 0.0) == 0
    quarter = Evaluation(
        Cell(Layout.REMOTE, targets=4, drafts=1), Speculation(2), result(), 1, None
    )
    assert [drafts_for(n, quarter) for n in (1, 4, 10, 1000)] == [1, 1, 3, 250]
    colocated = Evaluation(Cell(Layout.COLOCATED), Speculation(2), result(), 1, None)
    assert drafts_for(10, colocated) == 0
