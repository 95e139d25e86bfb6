"""Token trees (issue 36's core): a proposal of several continuations, scored in one
target pass with a tree attention mask, the kept path's KV cache moved into place.

1. the tree type and prompt lookup's trie;
2. one pass over a tree scores every node as a chain through its ancestors would;
3. greedy trees in process equal target-only on every prompt, round after round (the
   cache after a kept path is what a chain would have left), for random tree shapes;
4. SpecInfer's rule: exact enumeration over a tiny vocabulary with a negative control,
   a chi-square test of the real sampler, and a chain drawing what verify_sampled draws.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_runtime.batched_forward import Segment, SequenceKV, forward_segments
from specdec.v1 import common_pb2, orchestrator_pb2
from speculative import rejection
from speculative.errors import InvalidArgument
from speculative.generator import SpeculativeGenerator
from speculative.policy import FixedK
from speculative.prompt_lookup import NgramDrafter, lookup_continuation, lookup_tree
from speculative.rejection import (
    acceptance_probability,
    recovered_probs,
    verify_sampled,
    verify_tree_greedy,
    verify_tree_sampled,
)
from speculative.sampling import SamplingParams, SparseProbs, make_generator
from speculative.target import TargetSession
from speculative.token_tree import ROOT, TokenTree
from speculative.types import NextTokenKind, Verdict
from tests.system import LocalSystem
from tests.test_rejection import ALPHA, _chisquare_pvalue, _enumerate_rounds, _max_error, _World

# --- the tree type ----------------------------------------------------------------------


def test_a_trie_of_paths_shares_their_prefixes_and_keeps_the_first_path_first():
    tree = TokenTree.from_paths([[5, 6, 7], [5, 6, 8], [9], [5, 2]])
    assert tree.token_ids == (5, 6, 7, 8, 9, 2)
    assert tree.parents == (ROOT, 0, 1, 1, ROOT, 0)
    assert tree.depths() == [1, 2, 3, 3, 1, 2] and tree.depth() == 3
    assert tree.children(ROOT) == [0, 4] and tree.children(1) == [2, 3]
    assert tree.ancestors(3) == [0, 1, 3] and tree.path_tokens([0, 1, 3]) == [5, 6, 8]
    assert TokenTree.chain([3, 4]).is_chain and not tree.is_chain


@pytest.mark.parametrize(("token_ids", "parents", "message"), [
    ((1, 2), (ROOT,), "came with 1 parents"),
    ((1, 2), (ROOT, 1), "parent 1"),
    ((1, 2), (ROOT, -2), "parent -2"),
    ((1, 1), (ROOT, ROOT), "repeats its sibling's token 1"),
])
def test_a_malformed_tree_is_refused_with_what_is_wrong(token_ids, parents, message):
    with pytest.raises(InvalidArgument, match=message):
        TokenTree(token_ids, parents)


def test_lookup_proposes_every_distinct_continuation_its_first_as_a_chain_would():
    ids = [1, 2, 3, 4, 9, 1, 2, 7, 7, 1, 2, 3, 5, 1, 2]
    tree = lookup_tree(ids, 3, 2, 2, max_paths=8)
    assert tree == TokenTree.from_paths([[3, 4, 9], [7, 7, 1], [3, 5, 1]])
    assert tree.path_tokens(tree.ancestors(2)) == lookup_continuation(ids, 3, 2, 2)
    assert len(lookup_tree(ids, 3, 2, 2, max_paths=1)) == 3  # one path: the chain
    assert len(lookup_tree([1, 2, 3], 3, 2, 2, max_paths=4)) == 0


# --- one pass over a tree ---------------------------------------------------------------


def _chain_logits(model, token_ids: list[int]) -> torch.Tensor:
    return forward_segments(model, [Segment(SequenceKV(), 0, token_ids, len(token_ids))])[0]


def test_one_pass_scores_each_node_as_the_chain_through_its_ancestors(tiny_target, prompt_ids):
    prefix = prompt_ids[0]
    tree = TokenTree.from_paths([[11, 12, 13], [11, 14], [15, 16]])
    kv = SequenceKV()
    forward_segments(tiny_target.model, [Segment(kv, 0, prefix[:-1], 0)])  # the cached prefix
    parents = [-1] + [0 if parent == ROOT else parent + 1 for parent in tree.parents]
    segment = Segment(kv, len(prefix) - 1, [prefix[-1], *tree.token_ids], len(tree) + 1, parents=parents)
    logits = forward_segments(tiny_target.model, [segment])[0]
    for node in range(len(tree)):
        chain = _chain_logits(tiny_target.model, [*prefix, *tree.path_tokens(tree.ancestors(node))])
        torch.testing.assert_close(logits[node + 1], chain[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[0], _chain_logits(tiny_target.model, prefix)[-1], atol=1e-4, rtol=1e-4)


# --- greedy trees in process ------------------------------------------------------------


def _random_tree(rng: random.Random, truth: list[int], vocab_size: int) -> TokenTree:
    """A tree of random shape (up to 4 wide, 5 deep, 12 nodes) in which a random prefix
    of `truth` (the target's own continuation, possibly none of it) is one path."""
    keep = rng.randint(0, min(len(truth), 5))
    paths = [truth[:keep] + [rng.randrange(vocab_size) for _ in range(rng.randint(0, 2))]]
    for _ in range(rng.randint(0, 4)):
        shared = rng.randint(0, keep)
        paths.append(truth[:shared] + [rng.randrange(vocab_size) for _ in range(rng.randint(1, 4))])
    rng.shuffle(paths)
    tree = TokenTree.from_paths(path for path in paths if path)
    while len(tree) > 12:
        paths.pop()
        tree = TokenTree.from_paths(path for path in paths if path)
    return tree


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), prompt_index=st.integers(0, 3))
def test_greedy_trees_equal_target_only_round_after_round(tiny_target, prompt_ids, seed, prompt_index):
    prompt = prompt_ids[prompt_index]
    params = SamplingParams(max_new_tokens=24)
    expected = SpeculativeGenerator(tiny_target).generate(prompt, params, k=0).token_ids
    target = TargetSession(tiny_target, prompt, params)
    rng, out = random.Random(seed), []
    while len(out) < len(expected):
        tree = _random_tree(rng, expected[len(out):], tiny_target.vocab_size)
        result = target.verify_tree(target.length, tree)
        out += result.token_ids
        assert result.committed_len == len(prompt) + len(out) and target.length == result.committed_len
    assert out[: len(expected)] == expected


def test_a_chain_as_a_tree_decides_what_verify_decides(tiny_target, tiny_perturbed, prompt_ids):
    """Greedy and seeded sampling: same tokens, same draws (the generator's state after)."""
    for params in (SamplingParams(max_new_tokens=8), SamplingParams(temperature=0.9, seed=3, max_new_tokens=8)):
        for prompt in prompt_ids[:3]:
            draft = SpeculativeGenerator(tiny_perturbed).generate(prompt, SamplingParams(max_new_tokens=4), k=0)
            chain, tree = TargetSession(tiny_target, prompt, params), TargetSession(tiny_target, prompt, params)
            for _ in range(3):
                one = chain.verify(chain.length, draft.token_ids)
                other = tree.verify_tree(tree.length, TokenTree.chain(draft.token_ids))
                assert one.token_ids == other.token_ids and one.verdict == other.verdict
            if params.seed is not None:  # the same draws, so the same state after
                assert torch.equal(chain.generator.get_state(), tree.generator.get_state())


def test_a_stop_token_on_the_kept_path_ends_the_round_there(tiny_target, prompt_ids):
    prompt = prompt_ids[1]
    expected = SpeculativeGenerator(tiny_target).generate(prompt, SamplingParams(max_new_tokens=6), k=0).token_ids
    params = SamplingParams(max_new_tokens=6, stop_token_ids=(expected[2],))
    target = TargetSession(tiny_target, prompt, params)
    result = target.verify_tree(target.length, TokenTree.from_paths([expected[:5], [expected[0], 0]]))
    assert result.stopped and result.token_ids == expected[:3] and target.length == len(prompt) + 3


def test_a_tree_that_would_pass_the_context_is_refused_and_changes_nothing(tiny_target, prompt_ids):
    target = TargetSession(tiny_target, prompt_ids[0], SamplingParams(max_new_tokens=4))
    length = target.length
    with pytest.raises(InvalidArgument, match="over the limit of 128"):
        target.verify_tree(length, TokenTree.chain([1] * 129))
    with pytest.raises(InvalidArgument, match="outside the target vocabulary"):
        target.verify_tree(length, TokenTree((tiny_target.vocab_size,), (ROOT,)))
    assert target.length == length
    assert target.verify_tree(length, TokenTree.from_paths([[1], [2]])).committed_len == length + 1
    near_the_end = (prompt_ids[0] * tiny_target.context_length)[: tiny_target.context_length - 8]
    full = TargetSession(tiny_target, near_the_end, SamplingParams(max_new_tokens=4))
    with pytest.raises(InvalidArgument, match="would pass the context length"):
        full.verify_tree(full.length, TokenTree.from_paths([[1, 2, 3, 4], [5, 6, 7, 8]]))
    assert full.length == len(near_the_end)


# --- SpecInfer's rule -------------------------------------------------------------------

VOCAB, LENGTH = 5, 3


def _tree_at(world: _World, context: tuple[int, ...], widths: tuple[int, ...]) -> TokenTree:
    """The deterministic tree a draft would build here: at depth d, the widths[d] most
    likely draft tokens under each node of depth d - 1."""
    paths: list[list[int]] = [[]]
    for width in widths:
        grown = []
        for path in paths:
            probs = world.draft64(context + tuple(path))
            grown += [path + [token] for token in torch.argsort(probs, descending=True)[:width].tolist()]
        paths = grown
    return TokenTree.from_paths(paths)


def _tree_round_outcomes(world, context, widths, accept, recover) -> dict[tuple[int, ...], float]:
    """The exact probability of each token tuple one tree round commits: siblings tried in
    order against the residual the rejected ones left (one-hot draft distributions)."""
    tree = _tree_at(world, context, widths)
    outcomes: dict[tuple[int, ...], float] = defaultdict(float)

    def walk(node: int, prob: float) -> None:
        path = tuple(tree.path_tokens(tree.ancestors(node))) if node != ROOT else ()
        residual = world.target64(context + path)
        for child in tree.children(node):
            token_id = tree.token_ids[child]
            accepted = accept(float(residual[token_id]), 1.0)
            if accepted > 0.0:
                walk(child, prob * accepted)
            prob *= 1.0 - accepted
            residual = recover(residual, torch.nn.functional.one_hot(torch.tensor(token_id), VOCAB).double())
        for token_id, token_prob in enumerate(residual.tolist()):
            outcomes[path + (token_id,)] += prob * token_prob

    walk(ROOT, 1.0)
    return outcomes


def _enumerate_tree_generation(world, widths, accept=acceptance_probability, recover=recovered_probs):
    return _enumerate_rounds(lambda context: _tree_round_outcomes(world, context, widths, accept, recover), LENGTH)


@pytest.mark.parametrize("widths", [(2,), (3,), (2, 2), (3, 1), (1, 2), (2, 2, 2)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_sampling_enumerates_to_the_target_distribution(widths, seed):
    world = _World(seed, VOCAB, 3)
    enumerated = _enumerate_tree_generation(world, widths)
    assert sum(enumerated.values()) == pytest.approx(1.0, abs=1e-9)
    assert _max_error(world, enumerated, LENGTH) < 1e-6


@pytest.mark.parametrize("widths", [(2,), (2, 2)])
def test_a_skipped_residual_step_fails_the_enumeration(widths):
    """Negative control: a rejected sibling's token left in the residual."""
    world = _World(0, VOCAB, 3)
    enumerated = _enumerate_tree_generation(world, widths, recover=lambda residual, draft: residual)
    assert _max_error(world, enumerated, LENGTH) > 1e-3


def _sampled_pairs(world: _World, widths, num_runs: int, verify=verify_tree_sampled) -> Counter:
    generator, pairs = make_generator(99), Counter()
    for _ in range(num_runs):
        tokens: tuple[int, ...] = ()
        while len(tokens) < 2:
            tree = _tree_at(world, tokens, widths)
            rows = [world.target(tokens + tuple(tree.path_tokens(tree.ancestors(node)))) for node in range(len(tree))]
            target_probs = torch.stack([world.target(tokens), *rows])
            path, verdict = verify(tree, None, target_probs, generator)
            tokens += (*tree.path_tokens(path), verdict.next_token_id)
        pairs[tokens[:2]] += 1
    return pairs


STAT_WORLD, STAT_RUNS = _World(2024, 6, 3), 12_000


def test_tree_sampling_follows_the_target_by_chi_square():
    pairs = _sampled_pairs(STAT_WORLD, (2, 2), STAT_RUNS)
    expected = {(a, b): STAT_WORLD.autoregressive_prob((a, b)) for a in range(6) for b in range(6)}
    assert _chisquare_pvalue(pairs, expected) >= ALPHA


def test_a_skipped_residual_step_fails_the_chi_square(monkeypatch):
    monkeypatch.setattr(rejection, "recovered_probs", lambda residual, draft: residual)
    pairs = _sampled_pairs(STAT_WORLD, (2, 2), STAT_RUNS // 4)
    expected = {(a, b): STAT_WORLD.autoregressive_prob((a, b)) for a in range(6) for b in range(6)}
    assert _chisquare_pvalue(pairs, expected) < ALPHA


def test_a_sampled_chain_draws_what_verify_sampled_draws():
    world = _World(5, 6, 3)
    for seed in range(20):
        draft_ids, draft_probs = [], []
        for _ in range(3):
            probs = world.draft(tuple(draft_ids))
            draft_ids.append(int(probs.token_ids[seed % len(probs.token_ids)]))
            draft_probs.append(probs)
        target_probs = world.stacked_target((), tuple(draft_ids))
        chain = verify_sampled(draft_ids, draft_probs, target_probs, make_generator(seed))
        path, tree = verify_tree_sampled(TokenTree.chain(draft_ids), draft_probs, target_probs, make_generator(seed))
        assert chain == tree and path == list(range(chain.num_accepted))


def test_greedy_walks_to_the_target_argmax_and_says_how_it_ended():
    tree = TokenTree.from_paths([[1, 2], [3, 4]])  # nodes: 1, 2 (under 1), 3, 4 (under 3)
    logits = torch.zeros(5, 6)
    for row, token_id in enumerate([3, 0, 0, 4, 5]):  # root wants 3, node 3 wants 4, node 4 wants 5
        logits[row, token_id] = 1.0
    path, verdict = verify_tree_greedy(tree, logits)
    assert path == [2, 3] and verdict.next_token_id == 5 and verdict.next_token_kind is NextTokenKind.BONUS
    logits[3] = 0.0
    logits[3, 1] = 1.0  # node 2 wants 1: none of its children has it
    path, verdict = verify_tree_greedy(tree, logits)
    assert path == [2] and verdict == Verdict(1, 1, NextTokenKind.RECOVERED)


def test_only_an_only_child_may_carry_a_draft_distribution(tiny_target, prompt_ids):
    target = TargetSession(tiny_target, prompt_ids[0], SamplingParams(temperature=1.0, max_new_tokens=4))
    probs = SparseProbs.one_hot(1)
    with pytest.raises(InvalidArgument, match="node 0 has siblings"):
        target.verify_tree(target.length, TokenTree.from_paths([[1], [2]]), [probs, None])
    assert target.verify_tree(target.length, TokenTree.chain([1]), [probs]).committed_len >= target.length


# --- trees in the round loop, in process and through the services -----------------------


def test_lookup_trees_in_the_round_loop_equal_target_only(tiny_target, prompt_ids):
    """Fixed k = 4 with up to 4 of prompt lookup's continuations a round, greedy and with
    a stop token; the draft's session follows the kept path."""
    generator = SpeculativeGenerator(tiny_target, NgramDrafter(min_ngram=1, max_ngram=2))
    trees = 0
    for ids in prompt_ids:
        for params in (SamplingParams(max_new_tokens=40), SamplingParams(max_new_tokens=40, stop_token_ids=(32,))):
            policy = FixedK(4, width=4)
            result = generator.generate(ids, params, k=policy)
            assert result.token_ids == SpeculativeGenerator(tiny_target).generate(ids, params, k=0).token_ids
            trees += sum(result.stats.drafted_per_position[4:])
    assert trees > 0  # some round proposed more than a chain of 4 could


def _fixed_k_request(ids) -> orchestrator_pb2.GenerateRequest:
    request = orchestrator_pb2.GenerateRequest(include_stats=True)
    request.token_ids.ids.extend(ids)
    request.sampling.CopyFrom(common_pb2.SamplingParams(max_new_tokens=32))
    request.speculation.CopyFrom(common_pb2.SpeculationParams(num_speculative_tokens=4, drafter="ngram"))
    return request


@pytest.mark.parametrize("width", [1, 4])
def test_trees_through_the_services_equal_target_only(width, tiny_target, prompt_ids):
    """The draft worker's tree_width off (1) and on: exact both ways; only on does a
    round propose more tokens than k (a tree)."""
    system = LocalSystem()
    next(r for r in system.roles if r.pool == "draft").args.extend(
        ["--tree-width", str(width), "--prompt-lookup-min", "1", "--prompt-lookup-max", "2"])
    generator = SpeculativeGenerator(tiny_target)
    greedy = SamplingParams(max_new_tokens=32, stop_token_ids=(tiny_target.eos_token_id,))
    wider_than_k = 0
    with system:
        for ids in prompt_ids:
            response = system.stub.Generate(_fixed_k_request(ids), timeout=120)
            assert list(response.token_ids) == generator.generate(ids, greedy, k=0).token_ids, system.logs()
            wider_than_k += sum(response.stats.drafted_per_position[4:])
    assert (wider_than_k > 0) == (width > 1), wider_than_k
