"""AdaptiveK picks k from measured acceptance and costs; exactness never depends on it."""

from __future__ import annotations

from speculative.drafters import NgramDrafter
from speculative.generator import SpeculativeGenerator
from speculative.policy import AdaptiveK
from speculative.rejection import NextTokenKind
from speculative.sampling import SamplingParams
from speculative.stats import RoundStats

MS = 1_000_000  # nanoseconds


def _round(num_drafted, num_accepted, verify_ms, draft_ms=0.0):
    return RoundStats(
        0, 0, num_drafted, num_accepted, num_accepted + 1, NextTokenKind.BONUS,
        int(draft_ms * MS), int(verify_ms * MS), int(verify_ms * MS),
    )


def test_starts_at_max_k():
    assert AdaptiveK(6).next_k() == 6


def test_high_acceptance_and_cheap_verification_keep_k_high():
    policy = AdaptiveK(8)
    for _ in range(20):
        policy.observe(_round(8, 8, verify_ms=13.0))
        policy.observe(_round(0, 0, verify_ms=10.0))
    assert policy.next_k() == 8


def test_rejected_drafts_drive_k_to_zero_with_periodic_probes():
    policy = AdaptiveK(8, probe_every=4)
    for _ in range(20):
        policy.observe(_round(4, 0, verify_ms=17.0))
        policy.observe(_round(0, 0, verify_ms=10.0))
    choices = [policy.next_k() for _ in range(8)]
    assert choices.count(0) == 6 and choices.count(1) == 2  # a probe every 4th round


def test_a_costly_draft_lowers_k():
    """The same acceptance pays for a long proposal from a cheap drafter, not a costly one."""
    fast, slow = AdaptiveK(8), AdaptiveK(8)
    for _ in range(30):
        fast.observe(_round(4, 2, verify_ms=12.0))
        fast.observe(_round(1, 1, verify_ms=10.5))
        slow.observe(_round(4, 2, verify_ms=12.0, draft_ms=40.0))
        slow.observe(_round(1, 1, verify_ms=10.5, draft_ms=10.0))
    assert slow.next_k() < fast.next_k()


def test_adaptive_generation_is_still_exact(tiny_target, prompt_ids):
    params = SamplingParams(max_new_tokens=24)
    plain = SpeculativeGenerator(tiny_target)
    adaptive = SpeculativeGenerator(tiny_target, NgramDrafter())
    for ids in prompt_ids[:6]:
        assert adaptive.generate(ids, params, k=AdaptiveK(8)).token_ids == plain.generate(ids, params, k=0).token_ids
