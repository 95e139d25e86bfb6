"""The policy replay (benchmarks/replay_policy.py): the real round loop over synthetic
traces in virtual time, its arithmetic checked by hand."""

from __future__ import annotations

import random
import statistics

import pytest

from benchmarks.prompts import PROMPTS, prompt_texts
from benchmarks.replay_policy import (
    MAX_K,
    MAX_NEW_TOKENS,
    Clock,
    Costs,
    cascade_report,
    kinds_report,
    replay,
    replay_call,
    shifted,
    shifts_report,
)

PROMPT = list(range(10, 30))
PATH = list(range(100, 100 + MAX_NEW_TOKENS + MAX_K + 1))
FLAT = Costs((10.0,) * 12, draft_ms=1.0, round_trip_ms=0.0)  # every pass 10 ms


def _trace(right_for: int) -> dict:
    """A draft right for its first `right_for` tokens at every position, then wrong."""
    drafts = [
        [PATH[i + j] if j < right_for and i + j < len(PATH) else 0 for j in range(MAX_K)]
        for i in range(len(PATH))
    ]
    return {"prompt": PROMPT, "path": PATH, "stop_ids": [], "drafts": drafts}


def test_a_fixed_k_costs_its_drafting_and_one_pass_a_round():
    """Always right: a round of k = 2 commits 3 tokens for 2 ms of drafting and a 10 ms pass."""
    rate, _ = replay_call(_trace(right_for=MAX_K), "model", 2, FLAT, Clock(0.0, 0))
    assert rate == pytest.approx(3 / 0.012, rel=0.03)  # the last round is cut to the 64th token


def test_a_draft_wrong_from_its_third_token_makes_k2_the_best_fixed_k():
    rates = {
        k: replay_call(_trace(right_for=2), "model", k, FLAT, Clock(0.0, 0))[0]
        for k in (1, 2, 3, 4)
    }
    assert max(rates, key=rates.get) == 2
    # 4 drafted, 2 accepted and the target's token
    assert rates[4] == pytest.approx(3 / 0.014, rel=0.03)


def _random_trace(acceptance: float, seed: int) -> dict:
    """A draft whose every token is right with `acceptance` once the ones before it were."""
    rng, drafts = random.Random(seed), []
    for i in range(len(PATH)):
        row, right = [], True
        for j in range(MAX_K):
            right = right and rng.random() < acceptance
            row.append(PATH[i + j] if right and i + j < len(PATH) else 0)
        drafts.append(row)
    return {"prompt": PROMPT, "path": PATH, "stop_ids": [], "drafts": drafts}


def test_adaptive_is_within_5_percent_of_the_best_fixed_k_on_average():
    """Over 20 drafts of one acceptance (one call's best k in hindsight is mostly luck:
    the mean over calls is the fair bar), a draft token a fifth of a pass."""
    costs = Costs((10.0,) * 12, draft_ms=2.0, round_trip_ms=0.5)
    table = replay(
        {seed: _random_trace(0.8, 100 + seed) for seed in range(20)},
        "model",
        costs,
        jitter=0.0,
        repeats=1,
    )
    means = {
        method: statistics.fmean(rates[method] for rates in table.values()) for method in table[0]
    }
    best = max(rate for method, rate in means.items() if method != "adaptive")
    assert means["adaptive"] >= 0.95 * best


def test_a_stop_token_on_the_path_ends_the_call():
    trace = dict(_trace(right_for=MAX_K), stop_ids=[PATH[10]])
    clock = Clock(0.0, 0)
    rate, _ = replay_call(trace, "model", 4, FLAT, clock)
    assert rate == pytest.approx(11 / (clock.now_ns / 1e9))  # 11 tokens, the stop token last
    assert clock.now_ns == pytest.approx(3 * 14e6, rel=0.01)  # 5 + 5 + the stop in the third round


def test_a_shifted_call_starts_later_on_the_same_path():
    trace = _trace(right_for=2)
    later = shifted(trace, 3)
    assert later["prompt"] + later["path"] == trace["prompt"] + trace["path"]
    assert later["drafts"] == trace["drafts"][3:] and len(later["prompt"]) == len(PROMPT) + 3


def test_the_shifts_report_finds_the_fixed_k_every_shifted_call_prefers():
    """A draft right for 2 tokens everywhere: k=2 is the best fixed k in every shifted call,
    so a hindsight pick per call gains nothing over it."""
    report = shifts_report(
        "qwen", {"right2": _trace(right_for=2)}, FLAT, jitter=0.0, repeats=1, shifts=3
    )
    row = next(line for line in report.splitlines() if line.startswith("| right2"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1] == "k=2" and cells[4] == "1.000"
    assert 0.8 < float(cells[2]) <= 1.01


def test_the_kinds_report_picks_one_fixed_k_for_all_prompts_of_a_kind():
    """Two prompts of one kind, the draft right for 2 and for 3 tokens: one k is the kind's
    best, and each prompt's own best gains over it on the other prompt only."""
    traces = {"edit/1": _trace(right_for=2), "edit/2": _trace(right_for=3)}
    report = kinds_report("qwen", traces, FLAT, jitter=0.0, repeats=1)
    row = next(line for line in report.splitlines() if line.startswith("| edit"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1] in ("k=2", "k=3") and float(cells[5]) > 1.0
    assert 0.8 < float(cells[2]) <= 1.05


def test_the_cascade_report_sets_the_cascade_against_the_better_part():
    """A path that never repeats: lookup finds nothing to copy, so the cascade is the
    model drafter, round for round (1.000), and both beat lookup alone."""
    report = cascade_report({"new/1": _trace(right_for=3)}, FLAT, jitter=0.0, repeats=1)
    row = next(line for line in report.splitlines() if line.startswith("| new"))
    lookup, model, cascade, over_better, lowest = (
        float(cell) for cell in row.strip("|").split("|")[1:]
    )
    assert cascade == model > lookup and over_better == lowest == 1.0


def test_the_more_prompt_set_names_six_prompts_of_each_kind_and_all_adds_the_suites():
    texts = prompt_texts(("chat", "explain"), "more")
    assert len(texts) == 12 and "chat/1" in texts and "explain/6" in texts
    assert (
        prompt_texts(("chat",), "") == {"chat": PROMPTS["chat"]}
        and PROMPTS["chat"] not in texts.values()
    )
    assert (
        prompt_texts(("chat", "explain"), "all")
        == {"chat/0": PROMPTS["chat"], "explain/0": PROMPTS["explain"]} | texts
    )
