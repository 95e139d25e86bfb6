"""The pipelining replay's schedules (benchmarks/replay_pipeline.py) on synthetic traces."""

from __future__ import annotations

import pytest

from benchmarks.replay_pipeline import MAX_K, Replay, _line

PATH = list(range(100, 148))
PASS_S = [0.5 + 0.02 * w for w in range(MAX_K + 1)]


def _drafts(right: bool) -> list[list[int]]:
    """At each position, the path's continuation (a draft that is always right) or
    tokens the path never has."""
    return [
        [PATH[i + j] if right and i + j < len(PATH) else 0 for j in range(MAX_K)]
        for i in range(len(PATH))
    ]


def test_a_draft_that_is_always_right_gains_from_pipelining():
    run = Replay(PATH, _drafts(right=True), 0.15, PASS_S, 0.004)
    assert run.pipelined(3) > 1.3 * run.synchronous(3)


def test_a_draft_that_is_never_right_gains_nothing_and_loses_at_most_its_guess():
    run = Replay(PATH, _drafts(right=False), 0.15, PASS_S, 0.004)
    for k in (1, 3):
        assert run.synchronous(k) >= run.pipelined(k) >= run.synchronous(k) * 0.75
        assert run.synchronous(k) == pytest.approx(
            len(PATH) / (len(PATH) * (k * 0.15 + PASS_S[k] + 0.004)), rel=0.05
        )


def test_the_pass_costs_are_read_as_a_line():
    assert _line([1.0, 3.0, 2.0, 4.0]) == pytest.approx([1.3, 2.1, 2.9, 3.7])


def test_a_second_guess_keeps_the_proposals_ahead_that_the_first_loses():
    """Proposals of 3 always right, the draft's next-token guess always wrong but its
    second likeliest token right: only two guesses keep proposals ahead alive."""
    drafts = [
        [PATH[i + j] if j < 3 and i + j < len(PATH) else 0 for j in range(MAX_K)]
        for i in range(len(PATH))
    ]
    top = [[0, token] for token in PATH]
    run = Replay(PATH, drafts, 0.15, PASS_S, 0.004, top)
    assert run.pipelined(3, guesses=2) > 1.2 * run.pipelined(3)


def test_a_target_that_decodes_alone_while_it_would_idle_is_never_slower():
    for right in (False, True):
        run = Replay(PATH, _drafts(right), 0.15, PASS_S, 0.044)
        for k in (1, 3, 5):
            assert run.synchronous(k, fill=True) >= run.synchronous(k)
            assert run.pipelined(k, fill=True) >= 0.99 * run.pipelined(k)
