"""Drafters: whatever proposes the next few tokens, behind one small interface
(speculative.drafter_base: `Drafter.open` -> `DraftSession.propose(k)` -> `Proposal`).

Three drafters: a small model (`ModelDrafter`, here), prompt lookup (`NgramDrafter`),
and the two together (`LookupThenModelDrafter`): lookup where the context has text to
copy, the model elsewhere. The last two, and the interface, live in torch-free modules
(prompt_lookup.py, drafter_base.py) so that an n-gram draft worker never imports torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from model_runtime.loading import LoadedModel
from model_runtime.model_session import ForwardSteps, ModelSession, run_alone
from model_runtime.static_passes import passes_of
from speculative.drafter_base import (
    DEFAULT_DRAFT_TOP_K,
    Branch,
    Drafter,
    DraftSession,
    Proposal,
    with_branches,
)
from speculative.sampling import SamplingParams, SparseProbs, logits_to_probs, make_generator


def draft_seed(seed: int | None) -> int | None:
    """The draft's generator seed, derived from the request's, distinct from the target's."""
    if seed is None:
        return None
    digest = hashlib.sha256(f"draft:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# --- a small language model as drafter ------------------------------------------------


class ModelDrafter(Drafter):
    def __init__(self, loaded: LoadedModel, draft_top_k: int = DEFAULT_DRAFT_TOP_K):
        self.loaded = loaded
        self.name = f"model:{loaded.name}"
        self.fingerprint = loaded.fingerprint
        self.draft_top_k = draft_top_k

    def open(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> DraftSession:
        # The prompt runs with the first proposal, or at prefill(): a call may never draft.
        session = ModelSession(self.loaded.model, self.loaded.context_length)
        session.append(prompt_token_ids)
        return ModelDraftSession(session, params, self.draft_top_k)


class ModelDraftSession(DraftSession):
    def __init__(self, session: ModelSession, params: SamplingParams, draft_top_k: int):
        self.session = session
        self.params = params
        self.draft_top_k = draft_top_k
        self.generator = make_generator(draft_seed(params.seed))

    @property
    def length(self) -> int:
        return self.session.length

    def propose(self, k: int, min_reach: float = 0.0) -> Proposal:
        return run_alone(self.session.model, self.propose_steps(k, min_reach))

    def propose_tree(
        self, k: int, width: int, min_reach: float = 0.0, min_branch: float = 0.0
    ) -> Proposal:
        """A chain as `propose` drafts it, and up to width - 1 one-token branches: the
        draft's second choice where it is likeliest to be the target's (`with_branches`),
        each with a chance of at least min_branch."""
        return run_alone(self.session.model, self.propose_steps(k, min_reach, width, min_branch))

    def propose_steps(
        self, k: int, min_reach: float = 0.0, width: int = 1, min_branch: float = 0.0
    ) -> ForwardSteps[Proposal]:
        """`propose` (or `propose_tree`, width > 1) as up to k forward passes for a
        scheduler to batch with other sessions'. The branches cost no pass: the second
        choice comes from the logits that gave the first."""
        if (chain := self._device_chain(k, min_reach, width)) is not None:
            return Proposal(chain)
        token_ids, draft_probs, reach, branches = [], [], 1.0, []
        # the first token always
        while len(token_ids) < k and (not token_ids or reach >= min_reach):
            segment = self.session.pending_segment(1)  # the pending tokens: 1 or 2
            logits, _ = yield segment
            self.session.segment_done(segment)
            probs = self._distribution(logits[0], dense=bool(min_reach) or width > 1)
            if self.params.greedy:
                token_id = int(logits[0].argmax())
            else:
                token_id = probs.sample(
                    float(torch.rand(1, generator=self.generator, dtype=torch.float64))
                )
                draft_probs.append(probs)
            if (
                width > 1
                and (second := second_choice(probs, token_id))
                and reach * second[1] >= min_branch
            ):
                branches.append(Branch(reach * second[1], len(token_ids), second[0]))
            token_ids.append(token_id)
            reach *= probs.prob_of(token_id) if probs is not None else 1.0
            # The last token stays pending: it runs only if accepted (draft lag).
            self.session.append([token_id])
        chain = Proposal(token_ids, None if self.params.greedy else draft_probs)
        return with_branches(chain, branches, width - 1)

    def _device_chain(self, k: int, min_reach: float, width: int) -> list[int] | None:
        """A greedy chain drafted on the device, k passes back to back with one read back
        (model_runtime/static_passes.py, where passes are CUDA graphs); None where this
        proposal needs more than the tokens (sampling, confidence, branches) or does not fit."""
        passes = passes_of(self.session.model)
        if (
            passes is None
            or not passes.device_loop
            or not self.params.greedy
            or min_reach
            or width > 1
        ):
            return None
        return self.session.greedy_chain(k, passes.greedy_chain)

    def _distribution(self, logits: torch.Tensor, dense: bool) -> SparseProbs | None:
        """What the draft samples from (its draft_top_k most likely tokens); greedy: its
        softmax, where the caller reads probabilities (else None: argmax needs none)."""
        if not self.params.greedy:
            return SparseProbs.truncate(
                logits_to_probs(logits[None], self.params)[0], self.draft_top_k
            )
        if not dense:
            return None
        top = torch.softmax(logits.float(), -1).topk(2)
        return SparseProbs(top.indices.cpu(), top.values.cpu())

    def append(self, token_ids: Sequence[int]) -> None:
        self.session.append(token_ids)

    def truncate_to(self, length: int) -> None:
        self.session.truncate_to(length)

    def release(self) -> None:
        self.session.release()

    def prefill(self) -> None:
        self.session.prefill()

    def prefill_steps(self) -> ForwardSteps[None]:
        """`prefill` as forward passes for a scheduler."""
        return self.session.prefill_steps()

    def set_sampling(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = make_generator(draft_seed(params.seed))


def second_choice(probs: SparseProbs | None, token_id: int) -> tuple[int, float] | None:
    """The likeliest token other than token_id, and its probability; None where there is none."""
    if probs is None:
        return None
    others = probs.token_ids != token_id
    if not bool(others.any()):
        return None
    best = int(probs.probs.masked_fill(~others, -1.0).argmax())
    return int(probs.token_ids[best]), float(probs.probs[best])
