"""The costs file: a JSON round trip, its ranges, pass costs, acceptance from traces."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from foundation.pass_cost import PassCost
from planner.costs import (
    Acceptance,
    Costs,
    DraftStep,
    TargetPass,
    acceptance_from_continuations,
    acceptance_from_rounds,
    acceptance_from_spans,
)
from speculative.estimator import expected_tokens

EXAMPLE = Path(__file__).resolve().parents[2] / "planner" / "example_costs.json"


def test_a_costs_file_round_trips(make_costs, tmp_path):
    costs = make_costs(
        draft={"ms_by_batch": ((1, 2.0), (8, 3.0)), "colocated_ms_by_batch": ((1, 0.5),)},
        link={"one_way_ms": (0.5, 1.5, 3.0)},
    )
    costs.save(tmp_path / "costs.json")
    assert Costs.load(tmp_path / "costs.json") == costs


def test_the_example_file_loads():
    costs = Costs.load(EXAMPLE)
    assert costs.acceptance().k_max == 8 and costs.target.source and costs.draft.source


def test_another_schema_is_refused(make_costs):
    data = make_costs().to_dict() | {"schema": 99}
    with pytest.raises(ValueError, match="schema"):
        Costs.from_dict(json.loads(json.dumps(data)))


@pytest.mark.parametrize(
    "groups",
    [
        {"target": {"base_ms": -1.0}},
        {"target": {"max_sessions": 0}},
        {"draft": {"ms_by_batch": ()}},
        {"link": {"one_way_ms": ()}},
        {"request": {"new_tokens": 0}},
    ],
)
def test_inputs_out_of_range_are_refused(make_costs, groups):
    with pytest.raises(ValueError, match="out of range"):
        make_costs(**groups)


def test_an_acceptance_above_one_is_refused(make_costs):
    with pytest.raises(ValueError, match="workload test"):
        make_costs(acceptance=(0.5, 1.2))


def test_a_pass_costs_its_line_until_compute_bound():
    target = TargetPass(base_ms=5.0, per_token_ms=0.1, per_row_ms=0.5, compute_per_token_ms=0.2)
    assert target.pass_ms(rows=2, tokens=10) == pytest.approx(5.0 + 1.0 + 1.0)
    assert target.pass_ms(rows=1, tokens=1, prefill_tokens=99) == pytest.approx(20.0)  # compute
    prefill = dataclasses.replace(target, prefill_token_ms=0.01, compute_per_token_ms=0.0)
    assert prefill.pass_ms(1, 1, 100) == pytest.approx(5.0 + 0.1 + 0.5 + 1.0)


def test_a_pass_line_is_what_the_worker_reports():
    target = TargetPass(base_ms=5.0, per_token_ms=0.1, per_row_ms=0.5, prefill_token_ms=0.01)
    cost = target.step_cost(rows=4)  # foundation.pass_cost.PassCost, in ns
    assert cost == (7.0e6, 0.1e6, 0.01e6)
    again = TargetPass.from_step_cost(cost, per_row_ms=0.0, source="a worker's fit")
    assert again.pass_ms(1, 3, 100) == pytest.approx(target.pass_ms(4, 3, 100))
    assert TargetPass.from_step_cost(PassCost(1e6, 2e5)).prefill_token_ms is None


def test_a_draft_step_interpolates_by_batch():
    draft = DraftStep(ms_by_batch=((1, 2.0), (9, 4.0)), colocated_ms_by_batch=((1, 1.0),))
    assert [draft.step_ms(b) for b in (1, 5, 9, 13)] == [2.0, 3.0, 4.0, 5.0]
    assert draft.step_ms(50, colocated=True) == 1.0  # one point: flat
    assert DraftStep(ms_by_batch=((4, 3.0), (8, 5.0))).step_ms(1) == 3.0  # flat before the first
    falling = DraftStep(ms_by_batch=((1, 30.0), (2, 34.0), (3, 1.0)))  # a noisy last point
    assert falling.step_ms(3) == 1.0 and falling.step_ms(40) == 1.0  # never below it, never < 0


@pytest.mark.parametrize("acceptance, k", [(0.0, 3), (0.6, 1), (0.8, 4), (0.95, 8), (1.0, 5)])
def test_expected_tokens_at_one_acceptance_is_leviathans(acceptance, k):
    assert Acceptance((acceptance,) * k).expected_tokens(k) == pytest.approx(
        expected_tokens(acceptance, k)
    )


def test_expected_tokens_by_position():
    assert Acceptance((0.5, 0.8, 1.0)).expected_tokens(3) == pytest.approx(1 + 0.5 + 0.4 + 0.4)


def test_acceptance_from_rounds_conditions_each_position_on_the_ones_before():
    # (k, accepted): position 1 drafted 4 times, accepted 3; position 2 reached 3 times
    # (behind an accepted first), accepted twice; position 3 reached once, accepted; position
    # 4 never drafted: as position 3.
    rounds = [(3, 0), (3, 1), (2, 2), (3, 3)]
    assert acceptance_from_rounds(rounds, 4) == pytest.approx((3 / 4, 2 / 3, 1.0, 1.0))


def test_acceptance_from_continuations_starts_a_round_at_every_position():
    trace = {"path": [1, 2, 3, 4, 5], "drafts": [[1, 2, 9], [2, 3, 4], [9], [4, 5]]}
    rounds = acceptance_from_continuations(trace, k_max=3)
    assert rounds == [(3, 2), (3, 3), (1, 0), (1, 1)]  # the last: 1 token before the path ends


def test_acceptance_from_spans_reads_the_draft_workers_rounds(tmp_path):
    spans = tmp_path / "spans.jsonl"
    records = [
        {
            "name": "specdec.round",
            "trace_id": "0" * 32,
            "span_id": f"{i:016x}",
            "start_ns": 0,
            "end_ns": 1,
            "attributes": {
                "specdec.k": k,
                "specdec.accepted": accepted,
                "specdec.committed": accepted + 1,
                "specdec.draft_ns": 0,
                "specdec.verify_ns": 0,
                "specdec.target_compute_ns": 0,
            },
        }
        for i, (k, accepted) in enumerate([(2, 0), (2, 2)])
    ]
    spans.write_text("\n".join(json.dumps(r) for r in records))
    assert acceptance_from_spans([spans], 2) == pytest.approx((0.5, 1.0))
