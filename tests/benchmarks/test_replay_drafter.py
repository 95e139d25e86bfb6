"""The benchmark-only replay drafter (benchmarks/replay_drafter.py), a draft worker plug-in: the target's own
recorded greedy tokens, replaced at a set rate, at a real model's cost per token.

Its proposals agree with the target at the set rate (a binomial bound that fails a
drafter off by 0.1), outputs stay equal to target-only, every proposed token costs a
draft pass, and a draft worker offers it only when asked, greedy only.
"""

from __future__ import annotations

import grpc
import pytest

from benchmarks.replay_drafter import Replay, ReplayDrafter, write_replay
from draft_service.config import DraftConfig
from draft_service.drafting import Drafters
from draft_service.server import create_server as create_draft_server
from foundation.errors import InvalidArgument
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2_grpc
from speculative.generator import SpeculativeGenerator
from speculative.policy import FixedK
from speculative.sampling import SamplingParams
from speculative.types import DRAFTER_NAMES
from target_service.config import TargetConfig
from target_service.server import create_server as create_target_server
from tests.draft_service.test_draft_service import Pair, expect_error, tokens_of

MAX_NEW_TOKENS = 40
GREEDY = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
SAMPLED = common_pb2.SamplingParams(temperature=0.8, max_new_tokens=8)


@pytest.fixture(scope="module")
def recorded(tiny_target, prompt_ids) -> list[list[int]]:
    generator = SpeculativeGenerator(tiny_target)
    return [ids + generator.generate(ids, GREEDY, k=0).token_ids for ids in prompt_ids[:8]]


@pytest.mark.parametrize("acceptance", [0.0, 0.6, 0.9, 1.0])
def test_proposals_agree_with_the_target_at_the_set_rate(
    tiny_target, tiny_unrelated, prompt_ids, recorded, tmp_path, acceptance
):
    path = str(tmp_path / "replay.json")
    write_replay(path, acceptance, recorded)
    drafter = ReplayDrafter(tiny_unrelated, path)  # its own logits never matter
    agree = proposed = 0
    for ids, sequence in zip(prompt_ids, recorded):
        session = drafter.open(ids, GREEDY)
        passes = session.session.num_forward_passes
        while session.length < len(sequence):
            base = session.length
            proposal = session.propose(4)
            assert session.session.num_forward_passes - passes == len(proposal)  # a pass per token
            passes = session.session.num_forward_passes
            agree += sum(a == b for a, b in zip(proposal.token_ids, sequence[base:]))
            proposed += len(proposal)
            session.truncate_to(base)  # each position proposed once: independent draws
            session.append(sequence[base : base + len(proposal)])
    share = agree / proposed
    # three standard deviations: about 0.06 at 0.8
    bound = 3 * (acceptance * (1 - acceptance) / proposed) ** 0.5
    assert abs(share - acceptance) <= bound, (share, acceptance, proposed)


def test_speculation_with_it_equals_target_only(tiny_target, prompt_ids, recorded, tmp_path):
    path = str(tmp_path / "replay.json")
    write_replay(path, 0.8, recorded)
    generator = SpeculativeGenerator(tiny_target, ReplayDrafter(tiny_target, path))
    drafted = accepted = 0
    for ids, sequence in zip(prompt_ids, recorded):
        result = generator.generate(ids, GREEDY, FixedK(4))
        assert result.token_ids == sequence[len(ids) :]
        drafted += result.stats.num_drafted
        accepted += result.stats.num_accepted
    assert 0.4 < accepted / drafted < 0.95  # a chain stops at its first replaced token


def test_a_bad_replay_file_is_refused_with_what_is_wrong(tmp_path):
    path = tmp_path / "replay.json"
    path.write_text('{"acceptance": 1.5, "sequences": []}')
    with pytest.raises(InvalidArgument, match="acceptance must be in"):
        Replay.read(str(path))
    with pytest.raises(InvalidArgument, match="cannot read the replay file"):
        Replay.read(str(tmp_path / "missing.json"))


def test_a_draft_worker_offers_it_only_when_asked_and_greedy_only(
    tiny_target, prompt_ids, recorded, tmp_path
):
    with pytest.raises(InvalidArgument, match="needs a --model"):
        Drafters(None, "ngram", 2, 4, plugin="benchmarks.replay_drafter:drafters:x.json")
    path = str(tmp_path / "replay.json")
    plugin = f"benchmarks.replay_drafter:drafters:{path}"
    write_replay(path, 0.8, recorded)
    target = create_target_server(TargetConfig(address="127.0.0.1:0"), loaded_model=tiny_target)
    plain = create_draft_server(
        DraftConfig(address="127.0.0.1:0", default_drafter="model"), loaded_model=tiny_target
    )
    replaying = create_draft_server(
        DraftConfig(address="127.0.0.1:0", default_drafter="model", drafter_plugin=plugin),
        loaded_model=tiny_target,
    )
    services = (target, plain, replaying)
    for service in services:
        service.start()
    channels = [grpc.insecure_channel(f"127.0.0.1:{s.port}") for s in services]
    try:
        target_stub = target_pb2_grpc.TargetServiceStub(channels[0])
        address = f"127.0.0.1:{target.port}"
        expect_error(
            grpc.StatusCode.INVALID_ARGUMENT,
            draft_pb2_grpc.DraftServiceStub(channels[1]).OpenSession,
            draft_pb2.DraftOpenSessionRequest(prompt_token_ids=prompt_ids[0], drafter="x-replay"),
            match="offered only by a draft worker started with the --drafter-plugin",
        )
        stub = draft_pb2_grpc.DraftServiceStub(channels[2])
        pair = Pair(stub, target_stub, address, prompt_ids[0], drafter="x-replay")
        updates = pair.speculate(num_speculative_tokens=4)
        assert tokens_of(updates)[:16] == recorded[0][len(prompt_ids[0]) :][:16]
        assert sum(u.round.num_accepted for u in updates) > 0
        sampled = pair.request(sampling=SAMPLED, num_speculative_tokens=4)
        expect_error(grpc.StatusCode.INVALID_ARGUMENT, stub.Speculate, sampled, match="greedy only")
        pair.close()
    finally:
        for channel in channels:
            channel.close()
        for service in services:
            service.server.stop(0)


def test_a_plugin_is_loaded_by_name_and_its_names_are_checked(tiny_target):
    from draft_service.drafting import plugin_drafters

    with pytest.raises(InvalidArgument, match="MODULE:FUNCTION"):
        plugin_drafters("benchmarks.replay_drafter", None)
    with pytest.raises(InvalidArgument, match="cannot load the drafter plug-in"):
        plugin_drafters("benchmarks.no_such_module:drafters", None)
    with pytest.raises(InvalidArgument, match="start with 'x-'"):
        plugin_drafters("tests.benchmarks.test_replay_drafter:misnamed", None)
    assert "x-replay" not in DRAFTER_NAMES and "replay" not in DRAFTER_NAMES


def misnamed(model, argument):
    return {"replay": None}
