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

import dataclasses
import queue
import random
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foundation.errors import InvalidArgument
from model_runtime.batched_forward import Segment, SequenceKV, forward_segments
from specdec.v1 import common_pb2, orchestrator_pb2, target_pb2
from speculative import rejection
from speculative.drafter_base import Branch, Proposal, with_branches
from speculative.drafters import ModelDrafter, second_choice
from speculative.estimator import BRANCH_PRIOR_NODES, BRANCH_PRIOR_YIELD, CostEstimator
from speculative.generator import SpeculativeGenerator
from speculative.policy import AdaptiveK, FixedK
from speculative.prompt_lookup import NgramDrafter, lookup_continuation, lookup_tree
from speculative.rejection import (
    acceptance_probability,
    recovered_probs,
    verify_sampled,
    verify_tree_greedy,
    verify_tree_sampled,
)
from speculative.sampling import SamplingParams, SparseProbs, logits_to_probs, make_generator
from speculative.target import TargetSession
from speculative.token_tree import ROOT, TokenTree
from speculative.types import NextTokenKind, Verdict
from tests.local_system import LocalSystem
from tests.speculative.test_estimator import round_, settled, streamed
from tests.speculative.test_rejection import (
    ALPHA,
    _chisquare_pvalue,
    _enumerate_rounds,
    _max_error,
    _World,
)
from tests.target_worker import serving_target

# --- the tree type ----------------------------------------------------------------------


def test_a_trie_of_paths_shares_their_prefixes_and_keeps_the_first_path_first():
    tree = TokenTree.from_paths([[5, 6, 7], [5, 6, 8], [9], [5, 2]])
    assert tree.token_ids == (5, 6, 7, 8, 9, 2)
    assert tree.parents == (ROOT, 0, 1, 1, ROOT, 0)
    assert tree.depths() == [1, 2, 3, 3, 1, 2] and tree.depth() == 3
    assert tree.children(ROOT) == [0, 4] and tree.children(1) == [2, 3]
    assert tree.ancestors(3) == [0, 1, 3] and tree.path_tokens([0, 1, 3]) == [5, 6, 8]
    assert TokenTree.chain([3, 4]).is_chain and not tree.is_chain


@pytest.mark.parametrize(
    ("token_ids", "parents", "message"),
    [
        ((1, 2), (ROOT,), "came with 1 parents"),
        ((1, 2), (ROOT, 1), "parent 1"),
        ((1, 2), (ROOT, -2), "parent -2"),
        ((1, 1), (ROOT, ROOT), "repeats its sibling's token 1"),
    ],
)
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


def test_a_shorter_match_adds_the_alternatives_after_the_longer_ones():
    """Suffix (8, 1, 2) occurred once, followed by 3; suffix (1, 2) also by 7: the
    longer match's guess first, the shorter one's as its sibling."""
    ids = [8, 1, 2, 3, 4, 1, 2, 7, 6, 8, 1, 2]
    assert lookup_tree(ids, 2, 2, 3, max_paths=4) == TokenTree.from_paths([[3, 4], [7, 6]])
    assert lookup_tree(ids, 2, 3, 3, max_paths=4) == TokenTree.from_paths([[3, 4]])


# --- one pass over a tree ---------------------------------------------------------------


def _chain_logits(model, token_ids: list[int]) -> torch.Tensor:
    return forward_segments(model, [Segment(SequenceKV(), 0, token_ids, len(token_ids))])[0]


def test_one_pass_scores_each_node_as_the_chain_through_its_ancestors(tiny_target, prompt_ids):
    prefix = prompt_ids[0]
    tree = TokenTree.from_paths([[11, 12, 13], [11, 14], [15, 16]])
    kv = SequenceKV()
    forward_segments(tiny_target.model, [Segment(kv, 0, prefix[:-1], 0)])  # the cached prefix
    parents = [-1] + [0 if parent == ROOT else parent + 1 for parent in tree.parents]
    segment = Segment(
        kv, len(prefix) - 1, [prefix[-1], *tree.token_ids], len(tree) + 1, parents=parents
    )
    logits = forward_segments(tiny_target.model, [segment])[0]
    for node in range(len(tree)):
        chain = _chain_logits(tiny_target.model, [*prefix, *tree.path_tokens(tree.ancestors(node))])
        torch.testing.assert_close(logits[node + 1], chain[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        logits[0], _chain_logits(tiny_target.model, prefix)[-1], atol=1e-4, rtol=1e-4
    )


@pytest.fixture(scope="module")
def target_stub(tiny_target):
    """A target worker serving the tiny target on a real socket."""
    with serving_target(tiny_target, "target-trees") as stub:
        yield stub


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


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**32 - 1), prompt_index=st.integers(0, 3))
def test_greedy_trees_equal_target_only_round_after_round(
    tiny_target, prompt_ids, seed, prompt_index
):
    prompt = prompt_ids[prompt_index]
    params = SamplingParams(max_new_tokens=24)
    expected = SpeculativeGenerator(tiny_target).generate(prompt, params, k=0).token_ids
    target = TargetSession(tiny_target, prompt, params)
    rng, out = random.Random(seed), []
    while len(out) < len(expected):
        tree = _random_tree(rng, expected[len(out) :], tiny_target.vocab_size)
        result = target.verify_tree(target.length, tree)
        out += result.token_ids
        assert (
            result.committed_len == len(prompt) + len(out) and target.length == result.committed_len
        )
    assert out[: len(expected)] == expected


def _tree_rounds_over_grpc(
    stub, session_id: str, prompt: list[int], expected: list[int], seed: int, vocab_size: int
) -> list[int]:
    """Random trees on one Verify stream, each proposed once the last verdict came; the
    tokens the verdicts commit (the kept path's and the target's own)."""
    rng, out = random.Random(seed), []
    proposals: queue.SimpleQueue = queue.SimpleQueue()
    verdicts = stub.Verify(iter(proposals.get, None), timeout=60)
    while len(out) < len(expected):
        tree = _random_tree(rng, expected[len(out) :], vocab_size)
        draft = target_pb2.Draft(token_ids=tree.token_ids, parents=tree.parents)
        proposals.put(
            target_pb2.Proposal(session_id=session_id, base_len=len(prompt) + len(out), draft=draft)
        )
        decision = next(verdicts).decision
        assert all(
            tree.parents[node] == parent
            for parent, node in zip([ROOT, *decision.path], decision.path)
        )
        out += [tree.token_ids[node] for node in decision.path] + [decision.next_token_id]
        assert decision.committed_len == len(prompt) + len(out)
    proposals.put(None)
    return out


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_trees_over_the_verify_stream_equal_target_only(
    target_stub, tiny_target, prompt_ids, seed
):
    """Through the target worker's gRPC service, four sessions at once (their trees and
    chains batched into shared steps): every round's verdict keeps a path of its tree,
    and the tokens committed are the target's greedy ones."""
    params = SamplingParams(max_new_tokens=20)
    generator = SpeculativeGenerator(tiny_target)

    def one(index: int) -> bool:
        prompt = prompt_ids[index]
        expected = generator.generate(prompt, params, k=0).token_ids
        handle = target_stub.OpenSession(
            target_pb2.OpenSessionRequest(
                prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_new_tokens=20)
            ),
            timeout=60,
        ).handle
        try:
            out = _tree_rounds_over_grpc(
                target_stub,
                handle.session_id,
                prompt,
                expected,
                seed + index,
                tiny_target.vocab_size,
            )
        finally:
            target_stub.CloseSession(
                common_pb2.CloseSessionRequest(session_id=handle.session_id), timeout=60
            )
        return out[: len(expected)] == expected

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(one, range(4)))


def test_a_chain_as_a_tree_decides_what_verify_decides(tiny_target, tiny_perturbed, prompt_ids):
    """Greedy and seeded sampling: same tokens, same draws (the generator's state after)."""
    for params in (
        SamplingParams(max_new_tokens=8),
        SamplingParams(temperature=0.9, seed=3, max_new_tokens=8),
    ):
        for prompt in prompt_ids[:3]:
            draft = SpeculativeGenerator(tiny_perturbed).generate(
                prompt, SamplingParams(max_new_tokens=4), k=0
            )
            chain = TargetSession(tiny_target, prompt, params)
            tree = TargetSession(tiny_target, prompt, params)
            for _ in range(3):
                one = chain.verify(chain.length, draft.token_ids)
                other = tree.verify_tree(tree.length, TokenTree.chain(draft.token_ids))
                assert one.token_ids == other.token_ids and one.verdict == other.verdict
            if params.seed is not None:  # the same draws, so the same state after
                assert torch.equal(chain.generator.get_state(), tree.generator.get_state())


def test_a_stop_token_on_the_kept_path_ends_the_round_there(tiny_target, prompt_ids):
    prompt = prompt_ids[1]
    expected = (
        SpeculativeGenerator(tiny_target)
        .generate(prompt, SamplingParams(max_new_tokens=6), k=0)
        .token_ids
    )
    params = SamplingParams(max_new_tokens=6, stop_token_ids=(expected[2],))
    target = TargetSession(tiny_target, prompt, params)
    result = target.verify_tree(
        target.length, TokenTree.from_paths([expected[:5], [expected[0], 0]])
    )
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
            grown += [
                path + [token] for token in torch.argsort(probs, descending=True)[:width].tolist()
            ]
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
            residual = recover(
                residual, torch.nn.functional.one_hot(torch.tensor(token_id), VOCAB).double()
            )
        for token_id, token_prob in enumerate(residual.tolist()):
            outcomes[path + (token_id,)] += prob * token_prob

    walk(ROOT, 1.0)
    return outcomes


def _enumerate_tree_generation(
    world, widths, accept=acceptance_probability, recover=recovered_probs
):
    return _enumerate_rounds(
        lambda context: _tree_round_outcomes(world, context, widths, accept, recover), LENGTH
    )


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
            rows = [
                world.target(tokens + tuple(tree.path_tokens(tree.ancestors(node))))
                for node in range(len(tree))
            ]
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
        path, tree = verify_tree_sampled(
            TokenTree.chain(draft_ids), draft_probs, target_probs, make_generator(seed)
        )
        assert chain == tree and path == list(range(chain.num_accepted))


def test_greedy_walks_to_the_target_argmax_and_says_how_it_ended():
    tree = TokenTree.from_paths([[1, 2], [3, 4]])  # nodes: 1, 2 (under 1), 3, 4 (under 3)
    logits = torch.zeros(5, 6)
    for row, token_id in enumerate([3, 0, 0, 4, 5]):  # root wants 3, node 3 wants 4, node 4 wants 5
        logits[row, token_id] = 1.0
    path, verdict = verify_tree_greedy(tree, logits)
    assert (
        path == [2, 3]
        and verdict.next_token_id == 5
        and verdict.next_token_kind is NextTokenKind.BONUS
    )
    logits[3] = 0.0
    logits[3, 1] = 1.0  # node 2 wants 1: none of its children has it
    path, verdict = verify_tree_greedy(tree, logits)
    assert path == [2] and verdict == Verdict(1, 1, NextTokenKind.RECOVERED)


def test_a_draft_distribution_must_give_its_token_a_chance(tiny_target, prompt_ids):
    target = TargetSession(
        tiny_target, prompt_ids[0], SamplingParams(temperature=1.0, max_new_tokens=4)
    )
    with pytest.raises(InvalidArgument, match="draft"):
        target.verify_tree(
            target.length, TokenTree.from_paths([[1], [2]]), [SparseProbs.one_hot(3), None]
        )
    before = target.length
    result = target.verify_tree(
        before, TokenTree.from_paths([[1], [2]]), [SparseProbs.one_hot(1), None]
    )
    assert result.committed_len > before


# --- a model's second choices as branches: sampled chain, deterministic leaves ----------


def _branch_round_outcomes(world, context, depth, accept, recover) -> dict[tuple[int, ...], float]:
    """The exact probability of each token tuple one round commits where the draft samples
    a chain of `depth` tokens and branches its second choice under every one of them
    (`with_branches`): the draft's draws enumerated, then SpecInfer's rule, the sampled
    token first against its q, the second choice after it, one-hot."""
    outcomes: dict[tuple[int, ...], float] = defaultdict(float)

    def walk(path: tuple[int, ...], prob: float, level: int) -> None:
        residual = world.target64(context + path)
        if level == depth:
            for token_id, token_prob in enumerate(residual.tolist()):
                outcomes[path + (token_id,)] += prob * token_prob
            return
        draft, q = world.draft(context + path), world.draft64(context + path)
        for drawn in draft.token_ids.tolist():
            accepted = accept(float(residual[drawn]), float(q[drawn]))
            if accepted > 0.0:
                walk(path + (drawn,), prob * float(q[drawn]) * accepted, level + 1)
            rest, left = prob * float(q[drawn]) * (1.0 - accepted), recover(residual, q)
            second = second_choice(draft, drawn)
            if second is not None:
                took = accept(float(left[second[0]]), 1.0)
                for token_id, token_prob in enumerate(
                    world.target64(context + path + (second[0],)).tolist()
                ):
                    outcomes[path + (second[0], token_id)] += rest * took * token_prob
                rest = rest * (1.0 - took)
                left = recover(
                    left, torch.nn.functional.one_hot(torch.tensor(second[0]), VOCAB).double()
                )
            for token_id, token_prob in enumerate(left.tolist()):
                outcomes[path + (token_id,)] += rest * token_prob

    walk((), 1.0, 0)
    return outcomes


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_second_choice_branches_enumerate_to_the_target_distribution(depth, seed):
    world = _World(seed, VOCAB, 3)
    enumerated = _enumerate_rounds(
        lambda context: _branch_round_outcomes(
            world, context, depth, acceptance_probability, recovered_probs
        ),
        LENGTH,
    )
    assert sum(enumerated.values()) == pytest.approx(1.0, abs=1e-9)
    assert _max_error(world, enumerated, LENGTH) < 1e-6


def test_a_second_choice_judged_without_the_residual_fails_the_enumeration():
    """Negative control: the branch tried against the target's distribution, not what the
    rejected first choice left."""
    world = _World(0, VOCAB, 3)
    enumerated = _enumerate_rounds(
        lambda context: _branch_round_outcomes(
            world, context, 1, acceptance_probability, lambda residual, draft: residual
        ),
        LENGTH,
    )
    assert _max_error(world, enumerated, LENGTH) > 1e-3


def test_second_choice_branches_follow_the_target_by_chi_square():
    """The real sampler on the trees the model drafter builds: a sampled chain of 2 and
    its second choices (`with_branches`), the draft's q for the chain, one-hot below."""
    world, generator, pairs = STAT_WORLD, make_generator(7), Counter()
    for _ in range(STAT_RUNS):
        tokens: tuple[int, ...] = ()
        while len(tokens) < 2:
            chain, probs, branches = [], [], []
            for position in range(2):
                q = world.draft(tokens + tuple(chain))
                drawn = q.sample(float(torch.rand(1, generator=generator, dtype=torch.float64)))
                second = second_choice(q, drawn)
                if second is not None:
                    branches.append(Branch(second[1], position, second[0]))
                chain.append(drawn)
                probs.append(q)
            proposal = with_branches(Proposal(chain, probs), branches, 2)
            tree = TokenTree(tuple(proposal.token_ids), proposal.parents)
            rows = [
                world.target(tokens + tuple(tree.path_tokens(tree.ancestors(node))))
                for node in range(len(tree))
            ]
            path, verdict = verify_tree_sampled(
                tree, proposal.draft_probs, torch.stack([world.target(tokens), *rows]), generator
            )
            tokens += (*tree.path_tokens(path), verdict.next_token_id)
        pairs[tokens[:2]] += 1
    expected = {(a, b): STAT_WORLD.autoregressive_prob((a, b)) for a in range(6) for b in range(6)}
    assert _chisquare_pvalue(pairs, expected) >= ALPHA


def test_with_branches_hangs_the_likeliest_second_choices_under_the_chain():
    chain = Proposal([10, 11, 12])
    branches = [Branch(0.30, 0, 20), Branch(0.05, 1, 21), Branch(0.20, 2, 22)]
    tree = with_branches(chain, branches, 2)
    assert tree.token_ids == [10, 11, 12, 20, 22] and tree.parents == (ROOT, 0, 1, ROOT, 1)
    assert tree.appended() == [10, 11, 12]
    assert with_branches(chain, branches, 0) is chain


def test_model_branches_in_the_round_loop_equal_target_only(
    tiny_target, tiny_perturbed, prompt_ids
):
    """The model drafter at width 3, greedy and sampled with a seed: greedy equals
    target-only; a seeded sampled call is reproducible; the draft's session follows the
    kept path (a branch taken, its chain rolled back)."""
    generator = SpeculativeGenerator(tiny_target, ModelDrafter(tiny_perturbed))
    trees = 0
    for ids in prompt_ids:
        greedy = SamplingParams(max_new_tokens=24)
        result = generator.generate(ids, greedy, k=FixedK(4, width=3))
        assert (
            result.token_ids
            == SpeculativeGenerator(tiny_target).generate(ids, greedy, k=0).token_ids
        )
        trees += sum(result.stats.drafted_per_position[4:])
    assert trees > 0
    seeded = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5)
    first = generator.generate(prompt_ids[0], seeded, k=FixedK(4, width=3)).token_ids
    assert generator.generate(prompt_ids[0], seeded, k=FixedK(4, width=3)).token_ids == first


# --- trees in the round loop, in process and through the services -----------------------


def test_lookup_trees_in_the_round_loop_equal_target_only(tiny_target, prompt_ids):
    """Fixed k = 4 with up to 4 of prompt lookup's continuations a round, greedy and with
    a stop token; the draft's session follows the kept path."""
    generator = SpeculativeGenerator(tiny_target, NgramDrafter(min_ngram=1, max_ngram=2))
    trees = 0
    for ids in prompt_ids:
        for params in (
            SamplingParams(max_new_tokens=40),
            SamplingParams(max_new_tokens=40, stop_token_ids=(32,)),
        ):
            policy = FixedK(4, width=4)
            result = generator.generate(ids, params, k=policy)
            assert (
                result.token_ids
                == SpeculativeGenerator(tiny_target).generate(ids, params, k=0).token_ids
            )
            trees += sum(result.stats.drafted_per_position[4:])
    assert trees > 0  # some round proposed more than a chain of 4 could


def _fixed_k_request(ids, drafter: str) -> orchestrator_pb2.GenerateRequest:
    request = orchestrator_pb2.GenerateRequest(include_stats=True)
    request.token_ids.ids.extend(ids)
    request.sampling.CopyFrom(common_pb2.SamplingParams(max_new_tokens=32))
    request.speculation.CopyFrom(
        common_pb2.SpeculationParams(num_speculative_tokens=4, drafter=drafter)
    )
    return request


@pytest.mark.parametrize(("width", "drafter"), [(1, "ngram"), (4, "ngram"), (3, "model")])
def test_trees_through_the_services_equal_target_only(width, drafter, tiny_target, prompt_ids):
    """The draft worker's tree_width off (1) and on, for prompt lookup's tries and a
    model's second choices: exact both ways; only on does a round propose more tokens
    than k (a tree)."""
    system = LocalSystem(draft_tree_width=width)
    draft = next(r for r in system.roles if r.pool == "draft")
    draft.args.extend(["--prompt-lookup-min", "1", "--prompt-lookup-max", "2"])
    generator = SpeculativeGenerator(tiny_target)
    greedy = SamplingParams(max_new_tokens=32, stop_token_ids=(tiny_target.eos_token_id,))
    wider_than_k = 0
    with system:
        for ids in prompt_ids:
            response = system.stub.Generate(_fixed_k_request(ids, drafter), timeout=120)
            assert list(response.token_ids) == generator.generate(ids, greedy, k=0).token_ids, (
                system.logs()
            )
            wider_than_k += sum(response.stats.drafted_per_position[4:])
    assert (wider_than_k > 0) == (width > 1), wider_than_k


# --- the policy chooses the shape --------------------------------------------------------


def _tree_round(num_first, accepted_first, branch_nodes, branch_tokens, compute_ms):
    stats, elapsed = round_(num_first + branch_nodes, accepted_first + branch_tokens, compute_ms)
    return dataclasses.replace(
        stats, branch_nodes=branch_nodes, branch_tokens=branch_tokens
    ), elapsed


@pytest.mark.parametrize(("per_token_ms", "width"), [(0.5, 4), (30.0, 1)])
def test_trees_where_a_node_costs_the_pass_little_chains_where_it_costs_much(per_token_ms, width):
    """A memory-bound target (a node adds 0.5 ms to a 100 ms pass) gets trees on the prior
    yield; a compute-bound one (30 ms a node) chains."""
    policy = AdaptiveK(8, max_width=4)
    settled(
        policy,
        [*(round_(k, k // 2, 100.0 + per_token_ms * k) for k in (1, 4, 8)), streamed(100.0)],
    )
    assert policy.next_action().width == width


def test_branches_that_bring_nothing_turn_trees_off_and_age_back_into_a_probe():
    policy = AdaptiveK(8, max_width=4)
    settled(
        policy,
        [*(round_(k, k // 2, 100.0 + 0.5 * k) for k in (1, 4, 8)), streamed(100.0)],
    )
    for _ in range(10):  # 8 branch nodes a round, never on the kept path
        policy.observe_round(*_tree_round(8, 4, 8, 0, 104.0))
    assert policy.estimates().branch_yield < 0.05 and policy.next_action().width == 1
    for _ in range(40):  # chains: the evidence ages, the prior returns
        policy.observe_round(*round_(8, 4, 104.0))
    assert policy.next_action().width == 4


def test_a_trees_first_path_is_what_acceptance_learns():
    """Branch nodes neither count as rejected drafts nor as draft passes."""
    chains, trees = CostEstimator(8, max_width=4), CostEstimator(8, max_width=4)
    settled(chains, [round_(4, 2, 100.0)])
    settled(trees, [_tree_round(4, 2, 6, 1, 100.0)])
    assert trees.acceptances.rate() == pytest.approx(chains.acceptances.rate())
    nodes, tokens = 6 / 0.1, 1 / 0.1  # the settled decayed counts (decay 0.9)
    prior = BRANCH_PRIOR_YIELD * BRANCH_PRIOR_NODES
    assert trees.branch_yield() == pytest.approx(
        (prior + tokens) / (BRANCH_PRIOR_NODES + nodes), rel=1e-3
    )


def test_the_model_drafter_branches_only_where_its_chance_pays(
    tiny_target, tiny_perturbed, prompt_ids
):
    draft = ModelDrafter(tiny_perturbed).open(prompt_ids[0], SamplingParams(max_new_tokens=8))
    every = draft.propose_tree(4, 4)
    draft.truncate_to(len(prompt_ids[0]))
    none = draft.propose_tree(4, 4, min_branch=1.0)
    assert len(every) > 4 and every.appended() == none.token_ids and none.parents is None


def _exact_with_stop(
    loaded, prompt: list[int], params: SamplingParams, stop: int
) -> dict[tuple[int, ...], float]:
    """The target's distribution of its next tokens, enumerated, a sequence ending at `stop`."""
    distribution = {(): 1.0}
    for _ in range(params.max_new_tokens):
        grown: dict[tuple[int, ...], float] = defaultdict(float)
        for prefix, mass in distribution.items():
            if prefix and prefix[-1] == stop:
                grown[prefix] += mass
                continue
            with torch.inference_mode():
                logits = loaded.model(input_ids=torch.tensor([prompt + list(prefix)])).logits[
                    0, -1:
                ]
            probs = logits_to_probs(logits, params)[0].double()
            for token in probs.nonzero().flatten().tolist():
                grown[prefix + (token,)] += mass * float(probs[token])
        distribution = dict(grown)
    return distribution


def test_sampled_model_trees_through_the_services_follow_the_target(tiny_target, prompt_ids):
    """Chi-square through the three services: the draft worker's model (other random
    weights: often wrong, so branches are often tried) samples a chain of 2 and branches
    its second choices (--tree-width 3); the target judges them by SpecInfer's rule."""
    from tests.speculative.test_sampled_generation import ALPHA as SAMPLED_ALPHA
    from tests.speculative.test_sampled_generation import NUM_RUNS, _chi_square_p_value

    params = SamplingParams(temperature=1.0, top_k=4, max_new_tokens=3)
    # the launcher's --draft-tree-width
    prompt = prompt_ids[0]
    system = LocalSystem(draft_tree_width=3)

    def call(seed: int) -> tuple[tuple[int, ...], int]:
        request = orchestrator_pb2.GenerateRequest(include_stats=True)
        request.token_ids.ids.extend(prompt)
        request.sampling.CopyFrom(
            common_pb2.SamplingParams(temperature=1.0, top_k=4, max_new_tokens=3, seed=seed)
        )
        request.speculation.CopyFrom(
            common_pb2.SpeculationParams(num_speculative_tokens=2, drafter="model")
        )
        response = system.stub.Generate(request, timeout=60)
        return tuple(response.token_ids), sum(response.stats.drafted_per_position[2:])

    with system, ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(call, range(NUM_RUNS)))
    assert sum(branches for _, branches in runs) > NUM_RUNS // 4, (
        "rounds should have proposed trees"
    )
    exact = _exact_with_stop(tiny_target, prompt, params, tiny_target.eos_token_id)
    assert _chi_square_p_value(Counter(tokens for tokens, _ in runs), exact) > SAMPLED_ALPHA
