"""Each optimisation around the round loop (speculation_loop.Features) switched off and
on: output equal to target-only greedy both ways, and the optimisation seen at work only
where it is on. In process with a policy that asks for everything (rounds drafted ahead,
stretches with lookup run by the target, stretches after empty turns), and through the
services over a slow link, where adaptive calls decode stretches."""

from __future__ import annotations

import dataclasses

import pytest

from specdec.v1 import common_pb2, orchestrator_pb2
from speculative.drafters import ModelDrafter
from speculative.generator import LocalVerifier, SpeculativeGenerator
from speculative.policy import Action, SpeculationPolicy
from speculative.prompt_lookup import LookupThenModelDrafter, NgramDrafter
from speculative.sampling import SamplingParams
from speculative.speculation_loop import Features, speculation_rounds
from speculative.stretch_policy import Turn
from speculative.target import TargetSession
from tests.local_system import LocalSystem

GREEDY = SamplingParams(max_new_tokens=24)
SWITCHES = ("draft_ahead", "stretches", "target_lookup", "draft_stop")


class EverythingPolicy(SpeculationPolicy):
    """A round of 3 drafted ahead, then two stretches of 4 with lookup, in turn; a stretch
    after a turn that proposed nothing. min_reach above any chance: a model drafter
    that stops early proposes one token a round."""

    def __init__(self):
        super().__init__(3)
        self.turns = 0

    def next_action(self, remaining=None, turn=Turn.DRAFT, stretches=True) -> Action:
        if not stretches:
            return Action(k=3, ahead=True, min_reach=2.0)
        if turn is not Turn.DRAFT:
            return Action(stretch=4)
        self.turns += 1
        # A stretch asked for twice: the first may find a proposal ahead still to settle.
        return (
            Action(stretch=4, lookup_k=3)
            if self.turns % 3 != 1
            else Action(k=3, ahead=True, min_reach=2.0)
        )


class WatchingVerifier(LocalVerifier):
    """Overlaps and runs lookup (as across the network), and counts what was used."""

    def __init__(self, target):
        super().__init__(target, overlaps=True, runs_lookup=True)
        self.sent_ahead = self.stretches = self.looked_up = 0
        self.longest = 0  # the longest proposal not drafted ahead

    def send(
        self, base_len, draft_token_ids, draft_probs, expected_last_token_id=None, parents=None
    ):
        self.sent_ahead += expected_last_token_id is not None
        if expected_last_token_id is None:
            self.longest = max(self.longest, len(draft_token_ids))
        super().send(base_len, draft_token_ids, draft_probs, expected_last_token_id, parents)

    def decode(self, base_len, max_tokens, until=None, lookup=None):
        self.stretches += 1
        for result in super().decode(base_len, max_tokens, until, lookup):
            self.looked_up += result.num_drafted
            yield result


def _features(off: str | None) -> Features:
    return Features(**{name: off not in (name, "all") for name in SWITCHES})


@pytest.fixture(scope="module")
def references(tiny_bigram, prompt_ids):
    return [
        SpeculativeGenerator(tiny_bigram).generate(ids, GREEDY, k=0).token_ids for ids in prompt_ids
    ]


@pytest.mark.parametrize("off", [None, *SWITCHES, "all"])
@pytest.mark.parametrize("drafter_name", ["ngram", "model", "ngram+model"])
def test_each_optimisation_off_and_on_keeps_greedy_output(
    off, drafter_name, tiny_bigram, tiny_perturbed, prompt_ids, references
):
    drafter = {
        "ngram": NgramDrafter(),
        "model": ModelDrafter(tiny_bigram),
        "ngram+model": LookupThenModelDrafter(ModelDrafter(tiny_perturbed), NgramDrafter()),
    }[drafter_name]
    features = _features(off)
    used = dict.fromkeys(SWITCHES, 0)
    for ids, reference in zip(prompt_ids, references):
        target = TargetSession(tiny_bigram, ids, GREEDY)
        draft = drafter.open(ids, GREEDY)
        verifier = WatchingVerifier(target)
        tokens = [
            t
            for r in speculation_rounds(
                verifier,
                draft,
                len(ids),
                GREEDY,
                EverythingPolicy(),
                tiny_bigram.context_length,
                features,
            )
            for t in r.token_ids
        ]
        assert tokens == reference, (ids, off)
        used["draft_ahead"] += verifier.sent_ahead
        used["stretches"] += verifier.stretches
        used["target_lookup"] += verifier.looked_up
        used["draft_stop"] = max(used["draft_stop"], verifier.longest)
    used["draft_stop"] = int(
        used["draft_stop"] == 1
    )  # stopping, a model drafter proposes one token
    # Where each can show: the target runs only a pure lookup drafter; only the model
    # drafter's every proposal is its own (a cascade's lookup proposals are never cut).
    # A proposal cut short is never drafted ahead of (the draft could not go on).
    stopped_short = features.draft_stop and drafter_name == "model"
    shows = {
        "draft_ahead": not stopped_short,
        "stretches": True,
        "target_lookup": drafter_name == "ngram",
        "draft_stop": drafter_name == "model",
    }
    for name in SWITCHES:
        if (name == "draft_stop" and not shows[name]) or (name == "draft_ahead" and stopped_short):
            continue
        switched_on = (
            shows[name]
            and getattr(features, name)
            and (name != "target_lookup" or features.stretches)
        )
        assert (used[name] > 0) == switched_on, (name, used)


def _request(ids) -> orchestrator_pb2.GenerateRequest:
    request = orchestrator_pb2.GenerateRequest(include_stats=True)
    request.token_ids.ids.extend(ids)
    request.sampling.CopyFrom(common_pb2.SamplingParams(max_new_tokens=24))
    request.speculation.CopyFrom(
        common_pb2.SpeculationParams(num_speculative_tokens=4, drafter="ngram", adaptive=True)
    )
    return request


@pytest.mark.parametrize("switch", ["on", "off"])
def test_stretches_and_target_lookup_off_and_on_through_the_services(
    switch, tiny_target, prompt_ids
):
    """Over a 15 ms link adaptive calls decode stretches (the target running lookup's
    rounds in them); with both off, rounds only. Exact both ways."""
    system = LocalSystem(draft_target_delay_ms=15)
    if switch == "off":
        next(r for r in system.roles if r.pool == "draft").args.extend(
            ["--disable", "stretches,target_lookup"]
        )
    generator = SpeculativeGenerator(tiny_target)
    greedy = dataclasses.replace(GREEDY, stop_token_ids=(tiny_target.eos_token_id,))
    streamed = 0
    with system:
        for ids in prompt_ids[:4]:
            response = system.stub.Generate(_request(ids), timeout=120)
            assert list(response.token_ids) == generator.generate(ids, greedy, k=0).token_ids, (
                system.logs()
            )
            streamed += response.stats.num_streamed_tokens
    assert (streamed > 0) == (switch == "on"), streamed


def test_the_disable_option_names_each_optimisation_and_refuses_others():
    from foundation.errors import InvalidArgument
    from speculative.speculation_loop import DISABLE_NAMES, Features

    assert Features.disabled("") == Features()
    assert Features.disabled("pipeline, draft_stop") == Features(
        draft_ahead=False, draft_stop=False
    )
    every = Features.disabled(",".join(DISABLE_NAMES))
    assert not any(dataclasses.asdict(every).values())  # all off: the textbook loop
    with pytest.raises(InvalidArgument, match="choose among pipeline, stretches"):
        Features.disabled("stretch")
