"""TargetSession: verification commits exactly the verdict, and refuses stale proposals."""

from __future__ import annotations

import pytest

from foundation.errors import InvalidArgument, StaleProposal
from speculative.generator import SpeculativeGenerator
from speculative.prompt_lookup import LookupRounds, LookupStop, lookup_continuation
from speculative.rejection import NextTokenKind
from speculative.sampling import SamplingParams, SparseProbs
from speculative.target import TargetSession

GREEDY = SamplingParams(max_new_tokens=16)


def test_verify_commits_accepted_prefix_and_next_token(tiny_target, prompt_ids):
    ids = prompt_ids[0]
    reference = SpeculativeGenerator(tiny_target).generate(ids, GREEDY, k=0).token_ids
    target = TargetSession(tiny_target, ids, GREEDY)
    wrong = (reference[2] + 1) % tiny_target.vocab_size
    result = target.verify(len(ids), [reference[0], reference[1], wrong, 5])
    assert result.verdict.num_accepted == 2
    assert result.verdict.next_token_kind is NextTokenKind.RECOVERED
    assert result.token_ids == reference[:3]
    assert result.committed_len == target.length == len(ids) + 3
    # The next round continues from the committed tokens as if nothing was drafted.
    result = target.verify(len(ids) + 3, reference[3:6])
    assert result.token_ids == reference[3:7]
    assert result.verdict.next_token_kind is NextTokenKind.BONUS


def test_stale_or_duplicate_proposal_is_refused_and_changes_nothing(tiny_target, prompt_ids):
    ids = prompt_ids[1]
    target = TargetSession(tiny_target, ids, GREEDY)
    first = target.verify(len(ids), [1, 2])
    with pytest.raises(
        StaleProposal, match=f"extends length {len(ids)} but the session has {first.committed_len}"
    ):
        target.verify(len(ids), [1, 2])  # the same proposal again
    assert target.length == first.committed_len


@pytest.mark.parametrize(
    ("draft_token_ids", "draft_probs", "message"),
    [
        ([10**6], None, "outside the target vocabulary"),
        ([1, 2], [SparseProbs.one_hot(1)], "2 draft tokens came with 1 distributions"),
        ([1], [SparseProbs.one_hot(2)], "has probability 0"),
    ],
)
def test_bad_proposals_are_refused_before_anything_changes(
    tiny_target, prompt_ids, draft_token_ids, draft_probs, message
):
    ids = prompt_ids[2]
    target = TargetSession(tiny_target, ids, SamplingParams(temperature=1.0, seed=0))
    with pytest.raises(InvalidArgument, match=message):
        target.verify(len(ids), draft_token_ids, draft_probs)
    assert target.length == len(ids)
    assert target.verify(len(ids), []).committed_len == len(ids) + 1  # still serving


def test_proposal_past_the_context_is_refused(tiny_target):
    target = TargetSession(tiny_target, [7] * (tiny_target.context_length - 3), GREEDY)
    with pytest.raises(InvalidArgument, match="would pass the context length"):
        target.verify(target.length, [1, 2, 3])


@pytest.mark.parametrize("sizes", [(1, 1), (1, 3)])
def test_decoding_alone_ends_where_prompt_lookup_finds_text_to_copy(tiny_target, prompt_ids, sizes):
    """A stretch for the n-gram drafter ends after the first token at which
    the drafter would propose again: not before, not after; the tokens are the target's."""
    params = SamplingParams(max_new_tokens=32)
    ended_early = 0
    for ids in prompt_ids[:8]:
        reference = SpeculativeGenerator(tiny_target).generate(ids, params, k=0).token_ids
        copyable = [
            n
            for n in range(1, len(reference))
            if lookup_continuation([*ids, *reference[:n]], 1, *sizes)
        ]
        expected = reference[: copyable[0]] if copyable else reference
        target = TargetSession(tiny_target, ids, params)
        tokens = [r.token_ids[0] for r in target.decode(len(ids), 32, until=LookupStop(*sizes))]
        assert tokens == expected
        ended_early += len(tokens) < len(reference)
    assert ended_early >= 2  # the stop was really exercised


@pytest.mark.parametrize(("sizes", "max_draft_tokens"), [((1, 1), 1), ((1, 3), 4), ((2, 4), 16)])
def test_a_stretch_that_verifies_prompt_lookup_decodes_what_the_target_alone_does(
    tiny_bigram, prompt_ids, sizes, max_draft_tokens
):
    """A prompt-lookup drafter's rounds run by the target inside a stretch: each pass
    verifies what lookup finds to copy (at most max_draft_tokens, never past the
    stretch's tokens), and the tokens are exactly the target's own greedy ones (a
    target whose text repeats, so lookup is right often)."""
    params = SamplingParams(max_new_tokens=32)
    lookup = LookupRounds(LookupStop(*sizes), max_draft_tokens)
    verified = accepted = 0
    for ids in prompt_ids[:8]:
        reference = SpeculativeGenerator(tiny_bigram).generate(ids, params, k=0).token_ids
        for max_tokens in (32, 7):
            target = TargetSession(tiny_bigram, ids, params)
            results = list(target.decode(len(ids), max_tokens, lookup=lookup))
            assert [t for r in results for t in r.token_ids] == reference[:max_tokens]
            assert all(
                r.num_drafted <= max_draft_tokens and len(r.token_ids) == r.verdict.num_accepted + 1
                for r in results
            )
            assert target.length == len(ids) + max_tokens
            verified += sum(r.num_drafted for r in results)
            accepted += sum(r.verdict.num_accepted for r in results)
    # passes verified, accepted and rejected looked-up tokens
    assert accepted >= 10 and verified > accepted


def test_a_stretch_size_does_not_cut_a_looked_up_copy_short(tiny_bigram, prompt_ids):
    """With the call's room, the pass that crosses the stretch's size verifies all the
    lookup finds (the stretch ends after it), never past the room; the tokens are the
    target's own greedy ones."""
    params = SamplingParams(max_new_tokens=32)
    crossed = 0
    for ids in prompt_ids[:8]:
        reference = SpeculativeGenerator(tiny_bigram).generate(ids, params, k=0).token_ids
        for size, room in ((3, 20), (5, 9)):
            target = TargetSession(tiny_bigram, ids, params)
            list(
                target.decode(len(ids), 12)
            )  # the bigram's text repeats from here: lookup finds copies
            results = list(
                target.decode(len(ids) + 12, size, lookup=LookupRounds(LookupStop(1, 3), 8, room))
            )
            tokens = [t for r in results for t in r.token_ids]
            assert tokens == reference[12 : 12 + len(tokens)] and size <= len(tokens) <= room
            # it ended after the pass that crossed
            assert len(tokens) - len(results[-1].token_ids) < size
            crossed += len(tokens) > size
    assert crossed >= 3  # passes really went past the size


def test_lookup_rounds_are_bounded():
    for max_draft_tokens in (0, 17):
        with pytest.raises(InvalidArgument, match=r"max_draft_tokens must be in \[1, 16\]"):
            LookupRounds(LookupStop(1, 2), max_draft_tokens)
    with pytest.raises(InvalidArgument, match=r"room must be >= 0"):
        LookupRounds(LookupStop(1, 2), 4, room=-1)


def test_prompt_lookup_sizes_are_bounded():
    for sizes in [(0, 2), (3, 2), (1, 33)]:
        with pytest.raises(InvalidArgument, match="prompt_lookup_min <= prompt_lookup_max <= 32"):
            LookupStop(*sizes)
