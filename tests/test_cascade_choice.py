"""The cascade's choice between prompt lookup and the draft model (speculative.cascade_choice):
the rule, the scoring of guesses from verdicts, and the cascade session following it, off and on."""

from __future__ import annotations

import random

from speculative.cascade_choice import LOOKUP, MODEL, CascadeChoice
from speculative.drafter_base import DraftSession, Proposal
from speculative.prompt_lookup import LookupThenModelSession, NgramDraftSession
from speculative.sequence import TokenSequence


def _scored(choice: CascadeChoice, source: str, accepted: int, rounds: int, start: int = 0) -> int:
    """`rounds` verdicts on a 6-token guess of `source` of which `accepted` came; returns the next position."""
    position = start
    for _ in range(rounds):
        guess = list(range(100, 106))
        choice.guessed(source, position, guess)
        committed = guess[:accepted] + [999]
        choice.committed(position, committed)
        position += len(committed)
    return position


def test_lookup_is_taken_until_measured_and_priced_then_against_the_models_prior():
    choice = CascadeChoice()
    assert choice.takes_lookup()
    _scored(choice, LOOKUP, accepted=0, rounds=5)
    assert choice.takes_lookup()  # no price
    choice.drafting_share = 0.4
    assert not choice.takes_lookup()  # 1 < 0.6 * (1 + MODEL_PRIOR_TOKENS): the model is tried
    _scored(choice, LOOKUP, accepted=1, rounds=30, start=100)
    assert choice.takes_lookup()  # 2 >= 0.6 * 2


def test_the_rule_weighs_tokens_against_the_share_drafting_takes():
    """(1 + L) >= (1 - share) (1 + M): lookup 1 token a round against the model's 3."""
    choice = CascadeChoice(drafting_share=0.4)
    position = _scored(choice, LOOKUP, accepted=1, rounds=20)
    _scored(choice, MODEL, accepted=3, rounds=20, start=position)
    assert not choice.takes_lookup()  # 2 < 0.6 * 4
    choice.drafting_share = 0.5
    assert choice.takes_lookup()  # 2 >= 0.5 * 4
    choice.drafting_share = None
    assert choice.takes_lookup()


def test_a_guess_that_outruns_a_verdict_is_scored_by_the_next_one():
    choice = CascadeChoice(drafting_share=0.0)
    choice.guessed(MODEL, 10, [1, 2])
    choice.guessed(LOOKUP, 10, [1, 2, 3, 4])
    choice.committed(10, [1, 2, 3])  # the model's 2 and the target's token: lookup's 4th unknown
    assert choice._yields[MODEL] == [0.9 + 2.0, 0.9 + 1.0]  # the prior, aged by one round
    assert choice._yields[LOOKUP] == [0.0, 0.0]
    choice.committed(13, [5])
    assert choice._yields[LOOKUP] == [3.0, 1.0]


def test_a_guess_passed_by_a_stretch_is_dropped():
    choice = CascadeChoice(drafting_share=0.0)
    choice.guessed(LOOKUP, 10, [1, 2, 3])
    choice.committed(10, [1, 2])  # lookup's guess goes on at 12 ...
    choice.committed(20, [7])  # ... but the next verdict is after a stretch
    assert choice._yields[LOOKUP] == [0.0, 0.0] and not choice._pending


class _FixedModelSession(DraftSession):
    """A draft model that always proposes the target's next tokens from `truth`."""

    def __init__(self, truth: list[int], prompt_len: int):
        self.truth, self.tokens = truth, TokenSequence(truth[:prompt_len])

    @property
    def length(self) -> int:
        return len(self.tokens)

    def propose(self, k: int, min_reach: float = 0.0) -> Proposal:
        proposal = self.truth[self.length: self.length + k]
        self.tokens.append(proposal)
        return Proposal(proposal)

    def append(self, token_ids):
        self.tokens.append(token_ids)

    def truncate_to(self, length: int) -> None:
        self.tokens.truncate_to(length)


def _cascade_sources(share: float | None) -> list[str]:
    """Greedy rounds of k=3 over random text of 4 tokens, where lookup (1-grams) finds a
    continuation everywhere, right by chance, and the model knows the text: which half
    proposed each round."""
    truth = random.Random(0).choices(range(4), k=120)
    prompt_len = 8
    session = LookupThenModelSession(NgramDraftSession(truth[:prompt_len], 1, 1),
                                     _FixedModelSession(truth, prompt_len))
    sources, length = [], prompt_len
    while length < len(truth) - 4:
        guess = session.lookup.peek(3)
        session.price_drafting(share)
        proposal = session.propose(3)
        sources.append(LOOKUP if guess and proposal.token_ids == guess else MODEL)
        accepted = next((i for i, t in enumerate(proposal.token_ids) if t != truth[length + i]), len(proposal))
        committed = truth[length: length + accepted + 1]
        session.observe_commit(length, committed)
        session.truncate_to(length + accepted)
        session.append(committed[accepted:])
        length += len(committed)
    return sources


def test_the_cascade_sets_lookup_aside_where_its_matches_lose_and_not_when_switched_off():
    priced, unpriced = _cascade_sources(0.3), _cascade_sources(None)
    assert unpriced.count(MODEL) <= 1  # lookup wherever it finds a continuation: all but where a token is new
    assert priced[0] == LOOKUP and priced[-10:] == [MODEL] * 10  # once measured, the model's 3 tokens win


def test_a_plain_ngram_session_ignores_prices_and_verdicts():
    session = NgramDraftSession([1, 2, 3, 1, 2], 2, 2)
    session.price_drafting(0.9)
    session.observe_commit(5, [3])
    assert session.propose(2).token_ids == [3, 1]
