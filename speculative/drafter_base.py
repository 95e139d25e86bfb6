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

from speculative.stats import LookupCheck
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
    # committed token; None: a chain. Nodes of a tree carry draft_probs None where
    # deterministic (a looked-up path, a model's second choice).
    parents: tuple[int, ...] | None = None
    # Of a tree: how many first nodes, a path from the root, the draft session appended
    # (a model's chain under its branches); a chain is appended whole.
    tree_appended: int = 0
    # A cascade's prompt lookup this turn (its guess where the model proposed); None: none.
    lookup: LookupCheck | None = None
    lookup_ids: tuple[int, ...] = ()  # lookup's tokens, to check against the verdict

    def __len__(self) -> int:
        return len(self.token_ids)

    def appended(self) -> list[int]:
        """The tokens the draft session appended after the committed ones."""
        return self.token_ids if self.parents is None else self.token_ids[: self.tree_appended]


EMPTY_PROPOSAL = Proposal([])


@dataclass(frozen=True, order=True)
class Branch:
    """A one-token alternative to a chain's token at `position`."""

    chance: float  # the drafter's own estimate that the target takes it: the chain reached
    # `position` and chose this token, not the chain's
    position: int
    token_id: int


def with_branches(chain: Proposal, branches: Sequence[Branch], count: int) -> Proposal:
    """The chain and its `count` likeliest branches (by `chance`), as a tree whose first
    nodes are the chain, appended to the draft; the chain alone where none is taken."""
    chosen = sorted(sorted(branches, reverse=True)[: max(count, 0)], key=lambda b: b.position)
    if not chosen:
        return chain
    parents = (*range(-1, len(chain) - 1), *(branch.position - 1 for branch in chosen))
    probs = None if chain.draft_probs is None else [*chain.draft_probs, *(None for _ in chosen)]
    return Proposal(
        [*chain.token_ids, *(branch.token_id for branch in chosen)], probs, parents, len(chain)
    )


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

    def propose_tree(
        self, k: int, width: int, min_reach: float = 0.0, min_branch: float = 0.0
    ) -> Proposal:
        """Up to `width` continuations of up to k tokens each, as a token tree where the
        drafter finds several (Proposal.tree_appended of them appended); else what
        propose(k, min_reach) proposes. A drafter that knows its chances branches only
        where the branch's chance of being the target's is at least min_branch."""
        return self.propose(k, min_reach)

    def peek(self, k: int) -> list[int] | None:
        """What propose(k) would return now, the session unchanged, where that is free
        (prompt lookup); None where proposing costs a model pass."""
        return None

    def gate_lookup(self, refused: frozenset[int], max_tokens: int) -> None:
        """A cascade's prompt lookup leaves the turn to the model where it matched one of
        the `refused` n-gram sizes (speculative.lookup_gate), and where it takes the turn
        proposes up to max_tokens (more than k: its tokens cost no drafting). Other
        drafters ignore it."""

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
