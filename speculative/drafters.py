"""Drafters: whatever proposes the next few tokens, behind one small interface.

The interface maps one-to-one onto the draft service's RPCs: `Drafter.open` (open a
session, prefill), `DraftSession.propose(k)`, `append` / `truncate_to` (apply a verdict,
roll back), `release` (close).

Three drafters: a small model (`ModelDrafter`), prompt lookup (`NgramDrafter`), and the
two together (`LookupThenModelDrafter`): lookup where the context has text to copy, the
model elsewhere.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from speculative.errors import InvalidArgument
from speculative.fingerprint import ANY_VOCABULARY
from speculative.loading import LoadedModel
from speculative.model_session import ForwardSteps, ModelSession, run_alone
from speculative.sampling import SamplingParams, SparseProbs, logits_to_probs, make_generator
from speculative.types import DRAFTER_NAMES, MODEL, NGRAM, NGRAM_THEN_MODEL, check_drafter_name  # noqa: F401 - their home before

# Longest suffix prompt lookup will search for, in tokens: each size is one scan of the
# context (the target runs one per token of a stretch that ends at text to copy), and
# suffixes this long find nothing shorter ones do not (common settings are 2 to 5).
MAX_LOOKUP_NGRAM = 32
# Support of the draft's sparse distribution when sampling: the draft samples from its
# top tokens only, so the distribution sent with each token is small and still exact.
DEFAULT_DRAFT_TOP_K = 32


@dataclass(frozen=True)
class Proposal:
    """Draft tokens extending a committed length."""

    token_ids: list[int]  # [num_drafted], num_drafted <= k (a drafter may find nothing)
    # [num_drafted] the exact distributions the tokens were sampled from; None when the
    # proposal is deterministic (greedy drafting, n-gram lookup): one-hot distributions.
    draft_probs: list[SparseProbs] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)


EMPTY_PROPOSAL = Proposal([])


class DraftSession(abc.ABC):
    """The drafter's view of one sequence."""

    @property
    @abc.abstractmethod
    def length(self) -> int:
        """Tokens the session knows (committed plus its own unverified proposal)."""

    @abc.abstractmethod
    def propose(self, k: int) -> Proposal:
        """Proposes up to k tokens after the current sequence and appends them."""

    @abc.abstractmethod
    def append(self, token_ids: Sequence[int]) -> None: ...

    @abc.abstractmethod
    def truncate_to(self, length: int) -> None: ...

    def release(self) -> None:
        """Frees what the session holds (a KV cache)."""

    def prefill(self) -> None:
        """Runs appended input now rather than with the next proposal (model drafters)."""

    def set_sampling(self, params: SamplingParams) -> None:
        """Sampling from now on (model drafters sample like the target); a seed restarts
        the draft's generator."""

    def lookup_stop(self) -> LookupStop | None:
        """Where this drafter proposes only what prompt lookup finds (the n-gram drafter),
        the lookup's sizes: a stretch the target decodes alone can end at the first
        token after which the drafter would propose again. None: it may propose anywhere."""
        return None


@dataclass(frozen=True)
class LookupStop:
    """Prompt lookup's n-gram sizes, to tell where a sequence has a continuation to copy."""

    min_ngram: int
    max_ngram: int

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram <= MAX_LOOKUP_NGRAM:
            raise InvalidArgument(
                f"prompt lookup sizes need 1 <= prompt_lookup_min <= prompt_lookup_max <= {MAX_LOOKUP_NGRAM}, "
                f"got {self.min_ngram} and {self.max_ngram}"
            )

    def matches(self, token_ids: list[int]) -> bool:
        """Whether prompt lookup proposes after token_ids."""
        return bool(lookup_continuation(token_ids, 1, self.min_ngram, self.max_ngram))


class Drafter(abc.ABC):
    name: str
    fingerprint: str  # tokenizer fingerprint, or ANY_VOCABULARY

    @abc.abstractmethod
    def open(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> DraftSession: ...


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

    def propose(self, k: int) -> Proposal:
        return run_alone(self.session.model, self.propose_steps(k))

    def propose_steps(self, k: int) -> ForwardSteps[Proposal]:
        """`propose` as k forward passes for a scheduler to batch with other sessions'."""
        token_ids, draft_probs = [], []
        for _ in range(k):
            segment = self.session.pending_segment(1)  # the pending tokens: 1 or 2
            logits, _ = yield segment
            self.session.segment_done(segment)
            logits = logits[0]
            if self.params.greedy:
                token_id = int(logits.argmax())
            else:
                probs = SparseProbs.truncate(logits_to_probs(logits[None], self.params)[0], self.draft_top_k)
                token_id = probs.sample(float(torch.rand(1, generator=self.generator, dtype=torch.float64)))
                draft_probs.append(probs)
            token_ids.append(token_id)
            # The last token stays pending: it runs only if accepted (draft lag).
            self.session.append([token_id])
        return Proposal(token_ids, None if self.params.greedy else draft_probs)

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


# --- prompt lookup: no model at all ---------------------------------------------------


class NgramDrafter(Drafter):
    """Prompt lookup decoding (Saxena 2023): find the last n tokens earlier in the
    context and propose what followed them. Free to run, strong when the output copies
    the input (summaries, code edits, retrieval).

    Defaults from simulating rounds on SmolLM2-135M greedy outputs (benchmarks/prompts.py):
    single-token matches propose mostly wrong tokens and cost a verification each, so
    matches start at 2 tokens; the earliest occurrence (usually the source text in the
    prompt) beat the most recent one on every prompt kind.
    """

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4):
        LookupStop(min_ngram, max_ngram)  # checks the sizes
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.name = NGRAM
        self.fingerprint = ANY_VOCABULARY

    def open(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> DraftSession:
        return NgramDraftSession(list(prompt_token_ids), self.min_ngram, self.max_ngram)


class NgramDraftSession(DraftSession):
    def __init__(self, token_ids: list[int], min_ngram: int, max_ngram: int):
        self.token_ids = token_ids
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def propose(self, k: int) -> Proposal:
        proposal = lookup_continuation(self.token_ids, k, self.min_ngram, self.max_ngram)
        self.token_ids.extend(proposal)
        return Proposal(proposal)

    def append(self, token_ids: Sequence[int]) -> None:
        self.token_ids.extend(token_ids)

    def truncate_to(self, length: int) -> None:
        del self.token_ids[length:]

    def lookup_stop(self) -> LookupStop:
        return LookupStop(self.min_ngram, self.max_ngram)


def lookup_continuation(token_ids: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Up to k tokens that followed the earliest occurrence of the longest suffix of
    token_ids that occurs before (n from max_ngram down to min_ngram); [] if none does."""
    if k <= 0 or len(token_ids) <= min_ngram:
        return []
    sequence = torch.tensor(token_ids)
    length = len(token_ids)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # windows[i] = sequence[i : i + n], for every i with a token after the window.
        windows = sequence[: length - 1].unfold(0, n, 1)
        matches = (windows == sequence[-n:]).all(dim=1).nonzero()
        if len(matches):
            start = int(matches[0]) + n
            return token_ids[start : start + k]
    return []


# --- prompt lookup first, the model elsewhere -------------------------------------------


class LookupThenModelDrafter(Drafter):
    """Prompt lookup where the context has a continuation to copy, the draft model where
    it has none. Lookup is free and, on text that copies its input, right for long runs
    (Qwen2.5-Coder 1.5B: Hugging Face prompt lookup 1.68x on a code edit and a summary,
    where the 0.5B draft model gave 1.20-1.46x); the model drafts everything else.

    Exact under sampling as well: which of the two proposes depends on the context
    only, and a looked-up token is proposed with certainty (a one-hot draft
    distribution), so the target's rejection sampling sees the distribution each token
    was really drawn from."""

    def __init__(self, model: ModelDrafter, lookup: NgramDrafter):
        self.model, self.lookup = model, lookup
        self.name = f"{lookup.name}+{model.name}"
        self.fingerprint = model.fingerprint

    def open(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> DraftSession:
        return LookupThenModelSession(self.lookup.open(prompt_token_ids, params),
                                      self.model.open(prompt_token_ids, params))


class LookupThenModelSession(DraftSession):
    """Both sessions hold the same tokens: what one proposes is appended to the other
    (the model runs looked-up tokens with its next pass, as pending input)."""

    def __init__(self, lookup: DraftSession, model: DraftSession):
        self.lookup, self.model = lookup, model

    @property
    def length(self) -> int:
        return self.model.length

    def propose(self, k: int) -> Proposal:
        proposal = self.lookup.propose(k)
        if proposal:  # deterministic: draft_probs None, one-hot distributions
            self.model.append(proposal.token_ids)
            return proposal
        proposal = self.model.propose(k)
        self.lookup.append(proposal.token_ids)
        return proposal

    def append(self, token_ids: Sequence[int]) -> None:
        self.lookup.append(token_ids)
        self.model.append(token_ids)

    def truncate_to(self, length: int) -> None:
        self.lookup.truncate_to(length)
        self.model.truncate_to(length)

    def release(self) -> None:
        self.model.release()

    def prefill(self) -> None:
        self.model.prefill()

    def set_sampling(self, params: SamplingParams) -> None:
        self.model.set_sampling(params)
