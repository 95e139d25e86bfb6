"""The trees-under-load benchmark: its paired ratios, its verdict rule, and a small run through the services."""

from __future__ import annotations

import json

from benchmarks.bench_load import Cell, Run
from benchmarks.bench_load_trees import main, paired, verdicts


def _run(steady: dict[tuple[str, int, int], float]) -> Run:
    """A Run of closed-loop cells, (method, concurrency, repeat) -> steady tok/s (over 1 s)."""
    run = Run()
    run.cells = [Cell("closed", method, load, 1.0, [], repeat=repeat, steady=(int(value), 1.0))
                 for (method, load, repeat), value in steady.items()]
    return run


def test_trees_are_paired_with_chains_of_the_same_method_level_and_repeat():
    chains = _run({("k=0", 8, 0): 100, ("k=0", 8, 1): 50, ("k=4", 8, 0): 200, ("k=4", 8, 1): 100})
    trees = _run({("k=0", 8, 0): 110, ("k=0", 8, 1): 45, ("k=4", 8, 0): 180, ("k=4", 8, 1): 120})
    ratios = paired({1: chains, 4: trees}, 4)
    assert ratios == {("k=0", 8): [1.1, 0.9], ("k=4", 8): [0.9, 1.2]}


def test_a_width_is_slower_only_below_what_k0_moved_between_the_systems():
    ratios = {("k=0", 1): [0.95, 1.05, 1.0], ("k=4", 1): [0.96, 0.9, 0.99], ("adaptive", 1): [0.8, 0.85, 0.97],
              ("k=0", 8): [1.0], ("k=4", 8): [0.99]}
    assert verdicts(ratios) == {("k=4", 1): "not slower", ("adaptive", 1): "slower", ("k=4", 8): "slower"}


def test_a_small_run_through_the_services_writes_both_widths(tmp_path):
    status = main(["--pair", "tiny", "--concurrency", "1", "--max-new-tokens", "8", "--requests-per-client", "1",
                   "--repeats", "1", "--threads", "1", "--widths", "1,3", "--out", str(tmp_path)])
    assert status == 0
    runs = json.loads((tmp_path / "runs_load_trees_tiny.json").read_text())
    assert set(runs) == {"1", "3"}
    for cells in runs.values():
        assert {c["method"] for c in cells} == {"k=0", "k=4", "adaptive k<=4"}
        assert all(c["steady_tokens_per_s"] for c in cells)
    text = (tmp_path / "results_load_trees_tiny.md").read_text()
    assert "## Width 3 over width 1" in text and "width 3: 3 of 3" in text
