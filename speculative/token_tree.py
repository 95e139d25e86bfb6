"""A proposal of several continuations at once: a tree of draft tokens.

Node i is `token_ids[i]` with parent `parents[i]` (ROOT: the sequence's last committed
token); parents come before their children and siblings carry distinct tokens. A chain
is the tree whose node i has parent i - 1. The target scores every node in one pass
(each sees the committed prefix, its ancestors and itself), then walks the tree from
the root: the accepted path is the longest one whose every token the target keeps.

Free of torch: the n-gram drafter builds trees without a model runtime.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from foundation.errors import InvalidArgument

ROOT = -1  # the parent of a first-level node: the last committed token


@dataclass(frozen=True)
class TokenTree:
    token_ids: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self):
        if len(self.token_ids) != len(self.parents):
            raise InvalidArgument(
                f"a token tree of {len(self.token_ids)} tokens came with "
                f"{len(self.parents)} parents"
            )
        seen: set[tuple[int, int]] = set()
        for node, (token_id, parent) in enumerate(zip(self.token_ids, self.parents)):
            if not ROOT <= parent < node:
                raise InvalidArgument(
                    f"token tree node {node} has parent {parent}: a parent is "
                    f"{ROOT} (the last committed token) or an earlier node"
                )
            if (parent, token_id) in seen:
                raise InvalidArgument(
                    f"token tree node {node} repeats its sibling's token {token_id}"
                )
            seen.add((parent, token_id))

    @staticmethod
    def chain(token_ids: Sequence[int]) -> TokenTree:
        return TokenTree(tuple(token_ids), tuple(range(ROOT, len(token_ids) - 1)))

    @staticmethod
    def from_paths(paths: Iterable[Sequence[int]]) -> TokenTree:
        """The trie of `paths` (continuations of the committed tokens), in the order the
        paths first reach each node: the first path is the first branch everywhere."""
        token_ids: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, int], int] = {}
        for path in paths:
            parent = ROOT
            for token_id in path:
                node = index.get((parent, token_id))
                if node is None:
                    node = index[(parent, token_id)] = len(token_ids)
                    token_ids.append(token_id)
                    parents.append(parent)
                parent = node
        return TokenTree(tuple(token_ids), tuple(parents))

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return all(parent == node - 1 for node, parent in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Each node's depth: 1 for a child of the root."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent == ROOT else depths[parent] + 1)
        return depths

    def depth(self) -> int:
        """The longest path's length in tokens (0 for an empty tree)."""
        return max(self.depths(), default=0)

    def children(self, node: int) -> list[int]:
        """The children of `node` (ROOT: the first-level nodes), in order."""
        return [child for child, parent in enumerate(self.parents) if parent == node]

    def path_tokens(self, path: Sequence[int]) -> list[int]:
        return [self.token_ids[node] for node in path]

    def ancestors(self, node: int) -> list[int]:
        """`node` and its ancestors, root-most first."""
        chain = []
        while node != ROOT:
            chain.append(node)
            node = self.parents[node]
        return chain[::-1]
