"""The acceptance rule of speculative decoding, as pure functions.

No model, no network: given the draft's proposed tokens (and, when sampling, the exact
distributions it drew them from) and the target's distributions at the same positions,
decide how many draft tokens are accepted and which token the target adds.

Vocabulary (as in vLLM's RejectionSampler):
- accepted tokens: the prefix of the draft tokens the target keeps;
- a recovered token: sampled from the residual distribution at the first rejection;
- a bonus token: sampled from the target after all draft tokens were accepted.
Every round therefore commits `num_accepted + 1` tokens.

Sampling follows Leviathan et al. 2023 (arXiv:2211.17192, Algorithm 1) and Chen et al.
2023 (arXiv:2302.01318): accept draft token x with probability
min(1, target_prob(x) / draft_prob(x)); on rejection sample from
norm(max(0, target_probs - draft_probs)). The output then follows the target exactly.

On a token tree (speculative.token_tree) the rule is SpecInfer's multi-candidate one
(Miao et al. 2024, arXiv:2305.09781): a node's children are tried in order, each
against the residual the rejected ones before it left. Siblings are deterministic
proposals (one-hot draft distributions: lookup's continuations, a model's top picks),
so a rejected one only removes its token from the residual; with one child per node
the rule is Leviathan's, draw for draw.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from foundation.errors import InvalidArgument
from speculative.sampling import SparseProbs, greedy_tokens, sample_from
from speculative.token_tree import ROOT, TokenTree
from speculative.types import NextTokenKind, Verdict


def check_draft_tokens(draft_token_ids: Sequence[int], vocab_size: int) -> None:
    for position, token_id in enumerate(draft_token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidArgument(
                f"draft token {token_id} at position {position} is outside the target "
                f"vocabulary [0, {vocab_size})"
            )


def check_draft_probs(draft_token_ids: Sequence[int], draft_probs: Sequence[SparseProbs]) -> None:
    """Each draft token must have positive probability in the distribution sent with it."""
    if len(draft_probs) != len(draft_token_ids):
        raise InvalidArgument(
            f"{len(draft_token_ids)} draft tokens came with {len(draft_probs)} distributions"
        )
    for position, (token_id, probs) in enumerate(zip(draft_token_ids, draft_probs)):
        if not probs.prob_of(token_id) > 0.0:
            raise InvalidArgument(
                f"draft token {token_id} at position {position} has probability 0 in the "
                "distribution sent with it"
            )


def verify_greedy(draft_token_ids: Sequence[int], target_logits: torch.Tensor) -> Verdict:
    """Accept the draft tokens that equal the target's argmax.

    target_logits: [k + 1, vocab_size], row i scores the position of draft token i
    (row k the position after the last draft token).
    """
    k = len(draft_token_ids)
    assert target_logits.shape[0] == k + 1, (target_logits.shape, k)
    target_token_ids = greedy_tokens(target_logits)
    num_accepted = 0
    while num_accepted < k and draft_token_ids[num_accepted] == target_token_ids[num_accepted]:
        num_accepted += 1
    kind = NextTokenKind.BONUS if num_accepted == k else NextTokenKind.RECOVERED
    return Verdict(num_accepted, target_token_ids[num_accepted], kind)


def acceptance_probability(target_prob: float, draft_prob: float) -> float:
    """min(1, target_prob / draft_prob); draft_prob > 0 because the draft sampled it."""
    return 1.0 if target_prob >= draft_prob else target_prob / draft_prob


def recovered_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target_probs - draft_probs)), both [vocab_size].

    The residual is never all zero after a rejection in exact arithmetic; should rounding
    make it so (target and draft equal to the last bit), the target itself is the answer.
    """
    residual = torch.clamp(target_probs - draft_probs, min=0.0)
    total = residual.sum()
    return residual / total if total > 0 else target_probs


def verify_sampled(
    draft_token_ids: Sequence[int],
    draft_probs: Sequence[SparseProbs],
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """The Leviathan/Chen rule.

    draft_probs: [k] the exact (sparse) distributions the draft tokens were sampled from.
    target_probs: [k + 1, vocab_size], after the request's temperature / top-k / top-p.
    generator: the request's CPU generator; exactly k + 1 uniforms are drawn per call,
    whatever the outcome, so the generator's state depends only on the round count.
    """
    k = len(draft_token_ids)
    assert target_probs.shape[0] == k + 1, (target_probs.shape, k)
    check_draft_probs(draft_token_ids, draft_probs)
    uniforms = torch.rand(k + 1, generator=generator, dtype=torch.float64).tolist()
    target_probs = target_probs.float().cpu()
    for position, token_id in enumerate(draft_token_ids):
        draft_prob = draft_probs[position].prob_of(token_id)
        target_prob = float(target_probs[position, token_id])
        if uniforms[position] >= acceptance_probability(target_prob, draft_prob):
            dense_draft = draft_probs[position].to_dense(target_probs.shape[-1])
            residual = recovered_probs(target_probs[position], dense_draft)
            return Verdict(position, sample_from(residual, uniforms[k]), NextTokenKind.RECOVERED)
    bonus = sample_from(target_probs[k], uniforms[k])
    return Verdict(k, bonus, NextTokenKind.BONUS)


def check_tree_probs(tree: TokenTree, draft_probs: Sequence[SparseProbs | None]) -> None:
    """A draft distribution per node (None: deterministic), each giving its token a
    positive probability."""
    if len(draft_probs) != len(tree):
        raise InvalidArgument(
            f"{len(tree)} draft tokens came with {len(draft_probs)} distributions"
        )
    for node, probs in enumerate(draft_probs):
        if probs is not None:
            check_draft_probs([tree.token_ids[node]], [probs])


def verify_tree_greedy(tree: TokenTree, target_logits: torch.Tensor) -> tuple[list[int], Verdict]:
    """The path of nodes whose tokens equal the target's argmax, from the root, and the
    target's token after it. target_logits: [n + 1, vocab_size], row 0 the last
    committed token's, row i + 1 node i's."""
    assert target_logits.shape[0] == len(tree) + 1, (target_logits.shape, len(tree))
    target_token_ids = greedy_tokens(target_logits)
    path, node = [], ROOT
    while True:
        children = tree.children(node)
        wanted = target_token_ids[node + 1]
        match = next((child for child in children if tree.token_ids[child] == wanted), None)
        if match is None:
            kind = NextTokenKind.RECOVERED if children else NextTokenKind.BONUS
            return path, Verdict(len(path), wanted, kind)
        path.append(match)
        node = match


def verify_tree_sampled(
    tree: TokenTree,
    draft_probs: Sequence[SparseProbs | None] | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> tuple[list[int], Verdict]:
    """SpecInfer's rule. draft_probs: [n] the distribution each node was sampled from
    (None: deterministic, one-hot). target_probs: [n + 1, vocab_size], as in the greedy
    rule. Exactly n + 1 uniforms are drawn, node i's at i and the last token's at n,
    whatever the outcome: a chain draws what verify_sampled draws."""
    n = len(tree)
    assert target_probs.shape[0] == n + 1, (target_probs.shape, n)
    uniforms = torch.rand(n + 1, generator=generator, dtype=torch.float64).tolist()
    target_probs = target_probs.float().cpu()
    path, node = [], ROOT
    while True:
        residual = target_probs[node + 1]
        children = tree.children(node)
        for child in children:
            token_id = tree.token_ids[child]
            draft = (draft_probs[child] if draft_probs else None) or SparseProbs.one_hot(token_id)
            if uniforms[child] < acceptance_probability(
                float(residual[token_id]), draft.prob_of(token_id)
            ):
                path.append(child)
                node = child
                break
            residual = recovered_probs(residual, draft.to_dense(residual.shape[-1]))
        else:
            kind = NextTokenKind.RECOVERED if children else NextTokenKind.BONUS
            return path, Verdict(len(path), sample_from(residual, uniforms[n]), kind)
