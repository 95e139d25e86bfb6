"""The benchmark suite's measuring loop: every method runs once per repeat, and each
repeat starts one method later, so no method always runs first or last."""

from __future__ import annotations

from benchmarks.bench_suite import Run, measure


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
