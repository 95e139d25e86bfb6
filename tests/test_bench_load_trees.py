"""The trees-under-load benchmark: its paired ratios, their reading against k=0's drift, and a
small run through the services."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_load_trees import Row, against_drift, main, paired, verdict


def _rows(width: int, steady: dict[tuple[str, int, int], float]) -> list[Row]:
    """Rows of one width's systems, (method, concurrency, repeat) -> steady tok/s."""
    return [
        Row(width, method, load, repeat, value, 8, 8, 0)
        for (method, load, repeat), value in steady.items()
    ]


def test_trees_are_paired_with_chains_of_the_same_method_level_and_repeat():
    chains = _rows(
        1, {("k=0", 8, 0): 100, ("k=0", 8, 1): 50, ("k=4", 8, 0): 200, ("k=4", 8, 1): 100}
    )
    trees = _rows(
        4, {("k=0", 8, 0): 110, ("k=0", 8, 1): 45, ("k=4", 8, 0): 180, ("k=4", 8, 1): 120}
    )
    assert paired(chains + trees, 4) == {("k=0", 8): {0: 1.1, 1: 0.9}, ("k=4", 8): {0: 0.9, 1: 1.2}}


def test_a_width_is_slower_only_where_its_ratio_over_k0s_falls_beyond_the_noise():
    """k=0's ratio is the drift between the two systems: a method that moved with it did
    not change; one below it in every repeat, by about the same, is slower."""
    drift = {0: 0.90, 1: 1.10, 2: 1.00}
    ratios = {
        ("k=0", 1): drift,
        ("moved with the drift", 1): {r: 0.99 * d for r, d in drift.items()},
        ("slower", 1): {0: 0.81, 1: 0.99, 2: 0.89},
        ("noisy", 1): {0: 0.60, 1: 1.20, 2: 1.00},
    }
    judged = against_drift(ratios)
    assert judged[("k=0", 1)] is None
    assert judged[("moved with the drift", 1)] == pytest.approx((0.99, 0.99, 0.99))
    assert verdict(judged[("slower", 1)]).endswith("slower")
    assert verdict(judged[("noisy", 1)]).endswith("within the noise")
    # one repeat: no interval
    assert against_drift({("k=4", 1): {0: 0.9}, ("k=0", 1): {0: 1.0}})[("k=4", 1)] is None


def test_a_small_run_through_the_services_writes_both_widths_and_renders_again(tmp_path):
    status = main(
        [
            "--pair",
            "tiny",
            "--concurrency",
            "1",
            "--max-new-tokens",
            "8",
            "--requests-per-client",
            "1",
            "--repeats",
            "2",
            "--threads",
            "1",
            "--widths",
            "1,3",
            "--out",
            str(tmp_path),
        ]
    )
    assert status == 0
    saved = json.loads((tmp_path / "runs_load_trees_tiny.json").read_text())
    rows = [Row(**row) for row in saved["rows"]]
    assert {(r.width, r.method, r.repeat) for r in rows} == {
        (w, m, r) for w in (1, 3) for m in ("k=0", "k=4", "adaptive k<=4") for r in (0, 1)
    }
    assert all(r.steady_tokens_per_s and r.exact == r.completed == 1 and not r.failed for r in rows)
    report = (tmp_path / "results_load_trees_tiny.md").read_text()
    assert (
        "## Width 3 over width 1" in report
        and "width 3: 6 of 6 equal to the k=0 reference, 0 failed" in report
    )
    (tmp_path / "results_load_trees_tiny.md").unlink()
    assert (
        main(
            [
                "--pair",
                "tiny",
                "--render",
                str(tmp_path / "runs_load_trees_tiny.json"),
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert (tmp_path / "results_load_trees_tiny.md").read_text() == report
