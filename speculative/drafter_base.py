"""What every drafter implements and returns: `Drafter.open` gives a `DraftSession`,
whose `propose(k)` gives a `Proposal`.

The interface maps one-to-one onto the draft service's RPCs: `Drafter.open` (open a
session, prefill), `DraftSession.propose(k)`, `append` / `truncate_to` (apply a verdict,
roll back), `release` (close).

Free of torch on purpose (like types.py): the draft worker that serves only prompt
lookup (speculative.prompt_lookup) starts without a model runtime. The drafters are in
prompt_lookup.py and drafters.py (the small model).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from speculative.types import SamplingParams

if TYPE_CHECKING:
    from speculative.prompt_lookup import LookupStop
    from speculative.sampling import SparseProbs

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
    # A token tree (speculative.token_tree): each token's parent, -1 for the last
    # committed token; None: a chain. A tree is not appended to the draft's session.
    parents: tuple[int, ...] | None = None

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
    def propose(self, k: int, min_reach: float = 0.0) -> Proposal:
        """Proposes up to k tokens after the current sequence and appends them. A model
        drafter stops early once its own chance that the target accepts all of them so
        far (the product of its probabilities of its tokens) is below min_reach."""

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

    def propose_tree(self, k: int, width: int) -> Proposal:
        """Up to `width` continuations of up to k tokens each, as a token tree where the
        drafter finds several (not appended); else what propose(k) proposes."""
        return self.propose(k)

    def peek(self, k: int) -> list[int] | None:
        """What propose(k) would return now, the session unchanged, where that is free
        (prompt lookup); None where proposing costs a model pass."""
        return None

    def lookup_stop(self) -> LookupStop | None:
        """Where this drafter proposes only what prompt lookup finds (the n-gram drafter),
        the lookup's sizes: a stretch the target decodes alone can end at the first
        token after which the drafter would propose again. None: it may propose anywhere."""
        return None


class Drafter(abc.ABC):
    name: str
    fingerprint: str  # tokenizer fingerprint, or ANY_VOCABULARY

    @abc.abstractmethod
    def open(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> DraftSession: ...
