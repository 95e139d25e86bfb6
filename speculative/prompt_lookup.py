"""Prompt lookup as a drafter: alone (`NgramDrafter`, no model at all) or before a
small model (`LookupThenModelDrafter`: lookup where the context has text to copy, the
model elsewhere).

Free of torch on purpose (like drafter_base.py): a draft worker that serves only the
n-gram drafter starts in a fraction of the time a torch import takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from foundation.errors import InvalidArgument
from foundation.limits import MAX_SPECULATIVE_TOKENS
from foundation.sequence import TokenSequence
from model_runtime.fingerprint import ANY_VOCABULARY
from speculative.drafter_base import Drafter, DraftSession, Proposal
from speculative.stats import LookupCheck
from speculative.token_tree import TokenTree
from speculative.types import NGRAM, SamplingParams

# Longest suffix prompt lookup will search for, in tokens: each size is one scan of the
# context (the target runs one per token of a stretch that ends at text to copy), and
# suffixes this long find nothing shorter ones do not (common settings are 2 to 5).
MAX_LOOKUP_NGRAM = 32


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


@dataclass(frozen=True)
class LookupRounds:
    """A prompt-lookup drafter's rounds, run by the target inside a stretch: each pass
    also verifies up to max_draft_tokens looked-up tokens (what the drafter would have
    proposed there), so a free drafter's rounds cost no round trip each. room: tokens
    the call may still generate; a pass's lookup fills up to it, past the stretch's own
    size (the stretch then ends after that pass): a stretch's size is when the drafter
    decides again, and must not cut the copy a round of k would verify (0: the size)."""

    sizes: LookupStop
    max_draft_tokens: int
    room: int = 0

    def __post_init__(self):
        if not 1 <= self.max_draft_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidArgument(
                f"lookup_rounds.max_draft_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.max_draft_tokens}"
            )
        if self.room < 0:
            raise InvalidArgument(
                f"lookup_rounds.room must be >= 0 (0 = the stretch's max_tokens), got {self.room}"
            )

    def proposal(self, token_ids: list[int], room: int) -> list[int]:
        """What the pass after token_ids verifies, when `room` tokens may still come."""
        return lookup_continuation(
            token_ids,
            min(self.max_draft_tokens, room - 1),
            self.sizes.min_ngram,
            self.sizes.max_ngram,
        )


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
        self.tokens = TokenSequence(token_ids)
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    @property
    def length(self) -> int:
        return len(self.tokens)

    def propose(self, k: int, min_reach: float = 0.0) -> Proposal:
        proposal = self.peek(k)
        self.tokens.append(proposal)
        return Proposal(proposal)

    def propose_tree(
        self, k: int, width: int, min_reach: float = 0.0, min_branch: float = 0.0
    ) -> Proposal:
        tree = lookup_tree(self.tokens.ids, k, self.min_ngram, self.max_ngram, width)
        if tree.is_chain:
            self.tokens.append(tree.token_ids)
            return Proposal(list(tree.token_ids))
        return Proposal(list(tree.token_ids), parents=tree.parents)

    def peek(self, k: int) -> list[int]:
        return lookup_continuation(self.tokens.ids, k, self.min_ngram, self.max_ngram)

    def append(self, token_ids: Sequence[int]) -> None:
        self.tokens.append(token_ids)

    def truncate_to(self, length: int) -> None:
        self.tokens.truncate_to(length)

    def lookup_stop(self) -> LookupStop:
        return LookupStop(self.min_ngram, self.max_ngram)


def lookup_continuation(token_ids: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Up to k tokens that followed the earliest occurrence of the longest suffix of
    token_ids that occurs before (n from max_ngram down to min_ngram); [] if none does."""
    return lookup_match(token_ids, k, min_ngram, max_ngram)[1]


def lookup_match(
    token_ids: list[int], k: int, min_ngram: int, max_ngram: int
) -> tuple[int, list[int]]:
    """lookup_continuation's tokens, with the size n of the suffix it matched (0: none)."""
    if k <= 0 or len(token_ids) <= min_ngram:
        return 0, []
    length = len(token_ids)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # Only occurrences with a token after them: they start before length - n.
        start = _earliest_occurrence(token_ids, token_ids[-n:], length - n)
        if start is not None:
            return n, token_ids[start + n : start + n + k]
    return 0, []


def lookup_tree(
    token_ids: list[int], k: int, min_ngram: int, max_ngram: int, max_paths: int
) -> TokenTree:
    """Every distinct continuation, up to k tokens each, that followed an occurrence of a
    suffix of token_ids (n from max_ngram down to min_ngram; per n the earliest first),
    at most max_paths, merged into a trie: a longer match ranks first, a shorter one adds
    the alternatives the context holds where the longer one's guess fails. Its first
    path is lookup_continuation's."""
    if k <= 0 or len(token_ids) <= min_ngram:
        return TokenTree((), ())
    length, paths = len(token_ids), []
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        start = _earliest_occurrence(token_ids, token_ids[-n:], length - n)
        while start is not None and len(paths) < max_paths:
            path = token_ids[start + n : start + n + k]
            if path not in paths:
                paths.append(path)
            start = _earliest_occurrence(token_ids, token_ids[-n:], length - n, start + 1)
    return TokenTree.from_paths(paths) if paths else TokenTree((), ())


def _earliest_occurrence(
    token_ids: list[int], ngram: list[int], end: int, begin: int = 0
) -> int | None:
    """The smallest begin <= i < end with token_ids[i : i + len(ngram)] == ngram, or None."""
    i = begin  # list.index jumps from candidate to candidate in C: faster than torch's window compare
    while True:
        try:
            i = token_ids.index(ngram[0], i, end)
        except ValueError:
            return None
        if token_ids[i : i + len(ngram)] == ngram:
            return i
        i += 1


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

    def __init__(self, model: Drafter, lookup: NgramDrafter):
        """model: the small model (speculative.drafters.ModelDrafter)."""
        self.model, self.lookup = model, lookup
        self.name = f"{lookup.name}+{model.name}"
        self.fingerprint = model.fingerprint

    def open(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> DraftSession:
        return LookupThenModelSession(
            self.lookup.open(prompt_token_ids, params), self.model.open(prompt_token_ids, params)
        )


class LookupThenModelSession(DraftSession):
    """Both sessions hold the same tokens: what one proposes is appended to the other
    (the model runs looked-up tokens with its next pass, as pending input). Lookup leaves
    the turn to the model where its match's n-gram size is refused (`refuse_lookup`: the
    adaptive policy's gate, speculative.lookup_gate); each proposal carries lookup's
    guess, so that its worth is measured on the model's turns too."""

    def __init__(self, lookup: NgramDraftSession, model: DraftSession):
        self.lookup, self.model = lookup, model
        self.refused: frozenset[int] = frozenset()
        self.lookup_tokens = 0  # where lookup takes the next turn, up to this many (0: k)

    @property
    def length(self) -> int:
        return self.model.length

    def gate_lookup(self, refused: frozenset[int], max_tokens: int) -> None:
        self.refused, self.lookup_tokens = refused, max_tokens

    def propose(self, k: int, min_reach: float = 0.0) -> Proposal:
        size, guess = self._guess(self._lookup_k(k))
        if guess and size not in self.refused:  # deterministic: one-hot distributions
            proposal = self.lookup.propose(len(guess))  # the guess, appended
            self.model.append(proposal.token_ids)
            return _with_lookup(proposal, size, guess, proposed=True)
        proposal = self.model.propose(k, min_reach)
        self.lookup.append(proposal.token_ids)
        return _with_lookup(proposal, size, guess, proposed=False)

    def propose_tree(
        self, k: int, width: int, min_reach: float = 0.0, min_branch: float = 0.0
    ) -> Proposal:
        lookup_k = self._lookup_k(k)
        size, guess = self._guess(lookup_k)
        if guess and size not in self.refused:
            proposal = self.lookup.propose_tree(lookup_k, width)
            if proposal.parents is None:
                self.model.append(proposal.token_ids)
            return _with_lookup(proposal, size, guess, proposed=True)
        proposal = self.model.propose_tree(k, width, min_reach, min_branch)
        self.lookup.append(proposal.appended())
        return _with_lookup(proposal, size, guess, proposed=False)

    def _lookup_k(self, k: int) -> int:
        """Lookup's tokens for this proposal: the gate's max_tokens once (the round's own
        proposal; a proposal drafted ahead piece by piece keeps to its pieces)."""
        lookup_k, self.lookup_tokens = max(k, self.lookup_tokens), 0
        return lookup_k

    def _guess(self, k: int) -> tuple[int, list[int]]:
        lookup = self.lookup
        return lookup_match(lookup.tokens.ids, k, lookup.min_ngram, lookup.max_ngram)

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


def _with_lookup(proposal: Proposal, size: int, guess: list[int], proposed: bool) -> Proposal:
    """The proposal with what lookup proposed, or would have (nothing where it matched none)."""
    if not guess:
        return proposal
    check = LookupCheck(size, len(guess), proposed=proposed)
    return dataclasses.replace(proposal, lookup=check, lookup_ids=tuple(guess))
