"""Small costs files for the planner's tests: fast to simulate, with closed forms."""

from __future__ import annotations

import dataclasses

import pytest

from planner.costs import Acceptance, Arrivals, Costs, DraftStep, Link, Request, TargetPass


def small_costs(acceptance: tuple[float, ...] = (0.7,) * 6, **groups) -> Costs:
    """A target pass of 10 ms + 1 ms a token, a 2 ms draft step, a 1 ms link; each group
    (target, draft, link, request, arrivals) replaced by its keyword's fields."""
    base = Costs(
        target=TargetPass(base_ms=10.0, per_token_ms=1.0, max_sessions=8, source="test"),
        draft=DraftStep(ms_by_batch=((1, 2.0),), source="test"),
        workloads={"test": Acceptance(acceptance, "test")},
        link=Link(one_way_ms=(1.0,), source="test"),
        arrivals=Arrivals(10.0, "test"),
        request=Request(prompt_tokens=0, new_tokens=33, source="test"),
    )
    return dataclasses.replace(
        base,
        **{
            name: dataclasses.replace(getattr(base, name), **fields)
            for name, fields in groups.items()
        },
    )


@pytest.fixture
def make_costs():
    return small_costs
