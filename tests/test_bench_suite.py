"""The benchmark suite's measuring loop: every method runs once per repeat, in orders
that give each method every position and every predecessor alike. Its table says
which prompts a method is slower on beyond what the noise between paired repeats explains."""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks.bench_suite import (
    HF_ASSISTED,
    Run,
    against_hindsight,
    against_reference,
    chosen,
    measure,
    paired_ratio,
    round_order,
    runs_as_json,
    service_delays,
    table,
)


def test_repeats_are_interleaved_rotated_and_reversed():
    order = []

    def method(name):
        def run(value):
            order.append(name)
            return Run([1, 2], 1.0)

        return run

    results = measure({name: method(name) for name in "abc"}, {"prompt": None}, repeats=4)
    assert order == list("abccbabcaacb")
    assert {name: len(runs) for name, runs in results["prompt"].items()} == {"a": 4, "b": 4, "c": 4}


def test_six_rounds_of_three_methods_run_every_order_once():
    orders = {tuple(round_order(list("abc"), repeat)) for repeat in range(6)}
    assert len(orders) == 6
    predecessors = Counter((order[i - 1], order[i]) for order in orders for i in (1, 2))
    assert set(predecessors.values()) == {2}  # each method right after each other one twice


def test_every_run_is_compared_with_target_only():
    runs = {
        "target-only": [Run([1, 2], 1.0), Run([1, 2], 1.0)],
        "k=4": [Run([1, 2], 1.0), Run([1, 3], 1.0)],
    }
    lines, _ = table("t", {"prompt": runs}, baseline="target-only", reference="target-only")
    row = next(line for line in lines if line.startswith("| prompt |") and "tok/s" in line)
    assert row.endswith("| 3/4 |")


def _runs(seconds):
    return [Run([0] * 10, s) for s in seconds]


def test_paired_ratio_is_the_geometric_mean_with_a_t_interval():
    ratio, low, high = paired_ratio(_runs([2.0, 4.0]), _runs([1.0, 1.0]))  # 0.5x and 0.25x
    assert ratio == pytest.approx((0.5 * 0.25) ** 0.5)
    # log ratios -ln 2 and -ln 4: mean -1.5 ln 2, standard error 0.5 ln 2, t(0.975, 1) = 12.706
    assert low == pytest.approx(2 ** (-1.5 - 0.5 * 12.7062), rel=1e-4)
    assert high == pytest.approx(2 ** (-1.5 + 0.5 * 12.7062), rel=1e-4)
    assert paired_ratio(_runs([1.0]), _runs([1.0])) is None


def test_table_names_prompts_slower_beyond_the_noise_and_only_those():
    baseline = _runs([1.0, 1.2, 0.9, 1.1, 1.0])
    results = {
        # 10% slower every time, whatever the call's own speed: beyond the noise.
        "steady": {
            "target-only": baseline,
            "k=4": _runs([s * 1.1 for s in (1.0, 1.2, 0.9, 1.1, 1.0)]),
        },
        # 10% slower by the medians, but the pairs disagree: within the noise.
        "noisy": {"target-only": baseline, "k=4": _runs([1.4, 1.0, 1.2, 0.9, 1.1])},
    }
    lines, _ = table("t", results, baseline="target-only", reference="target-only")
    summary = next(line for line in lines if line.startswith("- k=4:"))
    assert (
        "slower than target-only beyond the 95% interval of paired repeats: steady 0.91x" in summary
    )
    assert "noisy" not in summary
    assert summary.endswith("faster: none")


def test_services_are_set_against_hf_assisted_raw_and_by_speedup():
    # HF assisted: 20 tok/s, 2x over HF generate. Services: adaptive 25 tok/s raw (1.25x)
    # but only 1.25x over a fast Decode (0.62x by speedup): behind, and named.
    reference = {"p": {"target-only (HF generate)": _runs([1.0]), HF_ASSISTED: _runs([0.5])}}
    services = {
        "p": {"target-only (Decode)": _runs([0.5]), "adaptive": _runs([0.4]), "k=4": _runs([0.2])}
    }
    lines = against_reference(
        "t", reference, "target-only (HF generate)", services, "target-only (Decode)"
    )
    row = next(line for line in lines if line.startswith("| p |"))
    assert (
        row
        == "| p | 20.00 tok/s (2.00x) | 1.25x raw, 0.62x by speedup | 2.50x raw, 1.25x by speedup |"
    )
    assert (
        "- adaptive: behind HF assisted (assistant_model) on p (1.25x raw, 0.62x by speedup)"
        in lines
    )
    assert "- k=4: behind HF assisted (assistant_model) on no prompt, either way" in lines


def test_every_run_is_kept_for_later_tables():
    measured = {"services, loopback": {"p": {"k=4": [Run([1, 2, 3], 0.123456)]}}}
    assert runs_as_json(measured) == {"services, loopback": {"p": {"k=4": [[3, 0.1235]]}}}


def test_a_methods_option_keeps_the_baseline_and_the_tables_order():
    table = {"lookup": 1, "model": 2, "cascade": 3, "cascade no gate": 4}
    assert chosen(table, "", ("lookup", "model"), "method") == list(table)
    assert chosen(table, "cascade no gate", ("model",), "method") == ["model", "cascade no gate"]
    with pytest.raises(SystemExit, match=r"no such method \['cascade no check'\]; there are"):
        chosen(table, "cascade,cascade no check", ("model",), "method")


def test_services_phases_run_loopback_first_unless_told_not_to():
    assert service_delays("1,5,20") == [0.0, 1.0, 5.0, 20.0]
    assert service_delays("1,5", loopback=False) == [1.0, 5.0]
    assert service_delays("") == [0.0]


def test_adaptive_is_set_against_the_fixed_k_fastest_on_each_prompt():
    def runs(seconds):
        return [Run([1] * 10, s) for s in seconds]

    results = {
        "copy": {
            "k=2": runs([2.0, 2.0]),
            "k=8": runs([1.0, 1.1]),
            "adaptive k<=8": runs([1.25, 1.3]),
        },
        "chat": {
            "k=2": runs([1.0, 1.0]),
            "k=8": runs([2.0, 2.0]),
            "adaptive k<=8": runs([1.0, 1.0]),
        },
    }
    lines = against_hindsight("t", results)
    assert any(line.startswith("| copy | k=8 (9.55) | 0.82x") for line in lines), lines
    assert any(line.startswith("| chat | k=2 (10.00) | 1.00x") for line in lines), lines
    assert lines[-2].endswith("lowest 0.82x")


def test_with_several_prompts_a_kind_adaptive_is_also_set_against_the_kinds_fixed_k():
    """k=2 wins one edit prompt and k=8 the other; over both, k=8 is the kind's k."""

    def runs(seconds):
        return [Run([1] * 10, s) for s in seconds]

    results = {
        "edit/1": {"k=2": runs([1.0]), "k=8": runs([1.1]), "adaptive k<=8": runs([1.0])},
        "edit/2": {"k=2": runs([2.0]), "k=8": runs([1.0]), "adaptive k<=8": runs([1.0])},
    }
    lines = against_hindsight("t", results)
    assert "| edit (2) | k=8 | 1.05x (lowest 1.00x) |" in lines, lines


def test_no_hindsight_table_without_two_fixed_k():
    assert (
        against_hindsight("t", {"p": {"k=4": [Run([1], 1.0)], "adaptive k<=8": [Run([1], 1.0)]}})
        == []
    )


def test_the_features_report_sets_each_switch_beside_all_on():
    from benchmarks.bench_features import report

    def runs(rate):
        return [Run([1, 2], 2 / rate), Run([1, 2], 2 / rate)]

    results = {"chat": {"target-only": runs(1.0), "all on": runs(2.0), "stretches off": runs(1.0)}}
    args = type("Args", (), {"threads": 2, "max_new_tokens": 8, "repeats": 2})()
    text = report("cmd", "smollm2", "ngram", results, args)
    assert "| chat | 2.00x [2.00, 2.00] | 1.00x [1.00, 1.00] |" in text
    assert "| geomean against all on | 1.000 | 0.500 |" in text
    assert "4 of 6 runs" not in text and "6 of 6 runs" in text


def test_the_ceiling_counts_runs_of_agreement_and_picks_the_best_k():
    from benchmarks.bench_drafts import ceiling, expected_tokens

    agreed = [True, True, False, True]  # runs from each point: 2, 1, 0, 1
    assert expected_tokens(agreed, 1) == 1 + (1 + 1 + 0 + 1) / 4
    assert expected_tokens(agreed, 8) == 1 + (2 + 1 + 0 + 1) / 4
    flat = dict.fromkeys(range(1, 10), 100.0)  # a pass costs the same at every width
    speedup, k = ceiling(agreed, 0.0, flat)
    # free drafts: the longest run counts; the smallest k that reaches it
    assert (speedup, k) == (
        2.0,
        2,
    )
