"""Benchmark workloads (benchmarks/workloads.py): MT-bench read from its installed
package, whole and cut, and the in-house set."""

from __future__ import annotations

import collections

import pytest

from benchmarks import workloads


def test_mt_bench_is_80_two_turn_questions_in_8_categories():
    conversations = workloads.load("mt-bench")
    assert len(conversations) == 80 and len({c.name for c in conversations}) == 80
    assert all(len(c.turns) == 2 and all(t.strip() for t in c.turns) for c in conversations)
    counts = collections.Counter(c.category for c in conversations)
    assert counts == dict.fromkeys(
        ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"],
        10,
    )


def test_a_workload_is_cut_by_category_and_turns():
    three = workloads.load("mt-bench", per_category=3, turns=1)
    assert len(three) == 24 and all(len(c.turns) == 1 for c in three)
    assert collections.Counter(c.category for c in three) == dict.fromkeys(
        {c.category for c in three}, 3
    )


def test_the_in_house_set_is_one_turn_per_kind():
    conversations = workloads.load("in-house")
    assert [c.category for c in conversations] == [
        "chat",
        "code_new",
        "code_edit",
        "summary",
        "explain",
    ]
    assert all(len(c.turns) == 1 for c in conversations)


def test_an_unknown_workload_is_an_error():
    with pytest.raises(ValueError, match="mt-bench"):
        workloads.load("spec-bench")
