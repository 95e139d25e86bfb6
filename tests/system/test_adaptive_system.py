"""Adaptive speculation through the three services as processes, with a delaying proxy
between draft and target (`benchmarks/delay_proxy.py`): the round trip costs more than a
round can win against ~1 ms tiny-model steps, so adaptive calls have the target decode
stretches alone (on the draft's Verify stream, each token relayed as an update).
Output stays exactly target-only greedy; seeded sampling draws what the in-process
generator draws with the same decisions; a session continues across calls.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec.v1 import common_pb2, orchestrator_pb2
from speculative.drafters import ModelDrafter
from speculative.generator import SpeculativeGenerator
from speculative.policy import Action, SpeculationPolicy
from speculative.sampling import SamplingParams
from speculative.stretch_policy import Turn
from tests.local_system import LocalSystem

MAX_NEW_TOKENS = 32
DELAY_MS = 15  # one way


def _request(
    ids, drafter: str, sampling: common_pb2.SamplingParams | None = None, session_id: str = ""
):
    request = orchestrator_pb2.GenerateRequest(include_stats=True, session_id=session_id)
    request.token_ids.ids.extend(ids)
    request.sampling.CopyFrom(sampling or common_pb2.SamplingParams(max_new_tokens=MAX_NEW_TOKENS))
    request.speculation.CopyFrom(
        common_pb2.SpeculationParams(num_speculative_tokens=4, drafter=drafter, adaptive=True)
    )
    return request


def _greedy(tiny_target) -> SamplingParams:
    """What the orchestrator asks for: greedy, and its end-of-text token stops."""
    return SamplingParams(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=(tiny_target.eos_token_id,))


@pytest.fixture(scope="module")
def slow_system():
    with LocalSystem(draft_target_delay_ms=DELAY_MS) as system:
        yield system


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_adaptive_generation_over_a_slow_link_decodes_stretches_and_stays_exact(
    slow_system, drafter, tiny_target, prompt_ids
):
    generator = SpeculativeGenerator(tiny_target)
    stretched = 0
    for ids in prompt_ids[:4]:
        response = slow_system.stub.Generate(_request(ids, drafter), timeout=120)
        expected = generator.generate(ids, _greedy(tiny_target), k=0).token_ids
        assert list(response.token_ids) == expected, slow_system.logs()
        assert response.stats.num_generated_tokens == len(expected)
        stretched += response.stats.num_streamed_tokens
    assert stretched >= 2 * MAX_NEW_TOKENS  # most tokens: speculation cannot pay here
    # Calls that end inside a stretch: the commit must not ask the draft to truncate to
    # tokens it never saw.
    orchestrator_log = (Path(slow_system.args.log_dir) / "orchestrator.log").read_text()
    assert "truncate on" not in orchestrator_log, orchestrator_log[-2000:]


def test_a_session_continues_across_stretches(slow_system, tiny_target, prompt_ids):
    """Two calls on one session equal one target-only run of both lengths: each call's
    stretches left draft and target at the same committed tokens."""
    ids = prompt_ids[1]
    first = slow_system.stub.Generate(_request(ids, "ngram"), timeout=120)
    second = slow_system.stub.Generate(
        _request([ids[0]], "ngram", session_id=first.session_id), timeout=120
    )
    expected = (
        SpeculativeGenerator(tiny_target)
        .generate([*ids, *first.token_ids, ids[0]], _greedy(tiny_target), k=0)
        .token_ids
    )
    assert list(second.token_ids) == expected


class ReplayedDecisions(SpeculationPolicy):
    """The decisions a call made through the services, replayed in process: k per round,
    and the length of each stretch."""

    def __init__(self, actions: list[Action]):
        super().__init__(max(a.k for a in actions))
        self.actions = list(actions)

    def next_action(self, remaining=None, turn=Turn.DRAFT, stretches=True) -> Action:
        assert turn is Turn.DRAFT, "a replayed k proposes what it proposed before"
        return self.actions.pop(0)


def _decisions(chunks) -> list[Action]:
    """The call's decisions from its chunks: a round ends with its recovered or bonus
    token (or, cut by a stop token or the length, with an accepted one) in the chunk
    that counts its drafts; consecutive tokens the target decoded alone are one stretch."""
    actions: list[Action] = []
    for chunk in chunks:  # a chunk may hold several updates (text held back)
        ends = 0
        for source in chunk.token_sources:
            if source == orchestrator_pb2.TOKEN_SOURCE_TARGET:
                stretched = actions[-1].stretch if actions and actions[-1].stretch else 0
                actions[len(actions) - bool(stretched) :] = [Action(stretch=stretched + 1)]
            elif source != orchestrator_pb2.TOKEN_SOURCE_ACCEPTED:
                ends += 1
                actions.append(Action(k=chunk.num_drafted))
        assert ends <= 1 or chunk.num_drafted == 0, "the drafts of one round per chunk"
        if not ends and chunk.num_drafted:  # a round cut by a stop token or the length
            actions.append(Action(k=chunk.num_drafted))
    return actions


def test_seeded_sampling_through_stretches_equals_the_same_decisions_in_process(
    tiny_target, prompt_ids
):
    """Which tokens a seeded sampled call draws depends on its decisions (k per round,
    stretches), which follow measured times; given the same decisions, the services
    draw exactly what the in-process generator draws. The draft drafts nothing ahead
    here (--disable pipeline): an abandoned proposal ahead consumes draft draws that a replay
    from the chunks cannot know of."""
    sampling = common_pb2.SamplingParams(temperature=0.9, seed=11, max_new_tokens=MAX_NEW_TOKENS)
    params = _greedy(tiny_target).replace(temperature=0.9, seed=11)
    replayed: list[Action] = []
    system = LocalSystem(
        draft_model="tiny-random:1", draft_target_delay_ms=DELAY_MS
    )  # drafts the target accepts
    next(r for r in system.roles if r.pool == "draft").args += ["--disable", "pipeline"]
    with system:
        for ids in prompt_ids[:4]:
            chunks = list(system.stub.GenerateStream(_request(ids, "model", sampling), timeout=120))
            decisions = _decisions(chunks)
            expected = SpeculativeGenerator(tiny_target, ModelDrafter(tiny_target)).generate(
                ids, params, k=ReplayedDecisions(decisions)
            )
            assert [t for c in chunks for t in c.token_ids] == expected.token_ids, decisions
            replayed += decisions
    assert any(a.stretch for a in replayed) and any(a.k for a in replayed), replayed
