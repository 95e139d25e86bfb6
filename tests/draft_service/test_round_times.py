"""draft_service.round_times: the draft-to-verify time ratio over a sliding window."""

from __future__ import annotations

import pytest

from draft_service.round_times import DraftVerifyWindow
from speculative.stats import RoundStats
from speculative.types import NextTokenKind

MS = 1_000_000


class FakeClock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def round_stats(draft_ms: float, verify_ms: float, streamed: bool = False) -> RoundStats:
    return RoundStats(
        index=0,
        base_len=10,
        num_drafted=0 if streamed else 4,
        num_accepted=0 if streamed else 2,
        num_committed=1 if streamed else 3,
        next_token_kind=NextTokenKind.RECOVERED,
        draft_ns=int(draft_ms * MS),
        verify_ns=int((verify_ms + 1) * MS),
        target_compute_ns=int(verify_ms * MS),
        streamed=streamed,
    )


def test_no_round_reads_zero():
    assert DraftVerifyWindow(clock=FakeClock()).ratio() == 0.0


def test_the_ratio_is_drafting_over_verifying_time_summed_over_the_rounds():
    """A sum over a sum: 2 + 6 ms drafting over 10 + 10 ms verifying is 0.4 (the mean
    of the rounds' own ratios, 0.2 and 0.6, would be the same only by chance)."""
    window = DraftVerifyWindow(clock=FakeClock())
    window.add(round_stats(draft_ms=2, verify_ms=10))
    window.add(round_stats(draft_ms=6, verify_ms=10))
    assert window.ratio() == pytest.approx(0.4)
    window.add(round_stats(draft_ms=1, verify_ms=30))  # a long pass weighs more
    assert window.ratio() == pytest.approx(9 / 50)


def test_rounds_out_of_the_window_are_dropped():
    clock = FakeClock(100.0)
    window = DraftVerifyWindow(window_s=30.0, bucket_s=1.0, clock=clock)
    window.add(round_stats(draft_ms=20, verify_ms=10))  # drafting held this one up: 2.0
    clock.now = 115.0
    window.add(round_stats(draft_ms=1, verify_ms=10))
    assert window.ratio() == pytest.approx(21 / 20)
    clock.now = 130.0  # the first round is 30 s old: still in
    assert window.ratio() == pytest.approx(21 / 20)
    clock.now = 130.5  # now older than the window
    assert window.ratio() == pytest.approx(0.1)
    clock.now = 145.5  # no round left: an idle worker reads 0
    assert window.ratio() == 0.0
    window.add(round_stats(draft_ms=5, verify_ms=10))
    assert window.ratio() == pytest.approx(0.5)


def test_rounds_without_a_pass_to_compare_do_not_count():
    """A stretch's token (the target decoding alone) and a round whose target reported
    no pass time leave the ratio as it was."""
    window = DraftVerifyWindow(clock=FakeClock())
    window.add(round_stats(draft_ms=3, verify_ms=10))
    window.add(round_stats(draft_ms=0, verify_ms=10, streamed=True))
    window.add(round_stats(draft_ms=5, verify_ms=0))
    assert window.ratio() == pytest.approx(0.3)
