"""The benchmark suite's measuring loop: every method runs once per repeat, and each
repeat starts one method later, so no method always runs first or last."""

from __future__ import annotations

from benchmarks.bench_suite import Run, measure, table


def test_repeats_are_interleaved_and_rotated():
    order = []

    def method(name):
        def run(value):
            order.append(name)
            return Run([1, 2], 1.0)
        return run

    results = measure({name: method(name) for name in "abc"}, {"prompt": None}, repeats=4)
    assert order == list("abc" "bca" "cab" "abc")
    assert {name: len(runs) for name, runs in results["prompt"].items()} == {"a": 4, "b": 4, "c": 4}


def test_every_run_is_compared_with_target_only():
    runs = {"target-only": [Run([1, 2], 1.0), Run([1, 2], 1.0)], "k=4": [Run([1, 2], 1.0), Run([1, 3], 1.0)]}
    lines, _ = table("t", {"prompt": runs}, baseline="target-only", reference="target-only")
    row = next(line for line in lines if line.startswith("| prompt |") and "tok/s" in line)
    assert row.endswith("| 3/4 |")
