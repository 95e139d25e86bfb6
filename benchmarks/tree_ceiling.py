"""How much a prompt-lookup tree can gain over the lookup chain, at most: recorded greedy
paths (benchmarks/replay_policy.py's traces) walked in rounds, each round proposing

- the chain: lookup's continuation of the context (speculative.prompt_lookup), as now;
- a tree of up to `--width` continuations (`lookup_tree`, the drafter's trees);
- every distinct continuation the context holds, at every n-gram size, however many
  (the ceiling of any tree lookup can build from one call's context);
- the same plus every continuation in the other prompts' recorded contexts and outputs
  (a cache across requests, SuffixDecoding-like, leave-one-out).

A proposal is accepted up to its first token off the target's path, so tokens per pass
are exact. Speed is read two ways: with every pass costing the same whatever its width
(the best case for trees, a GPU's below its compute bound), and priced by the pair's
calibrated pass costs by width (replay_policy.COSTS). No model runs: seconds.

    .venv/bin/python -m benchmarks.tree_ceiling --pair qwen --min-ngram 1
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from benchmarks.prompts import kind_of
from benchmarks.replay_policy import COSTS, MAX_NEW_TOKENS, Costs, load_traces
from speculative.prompt_lookup import lookup_continuation, lookup_tree

UNLIMITED = 1 << 30  # paths in a tree of every continuation
HISTORY = ", + other calls"  # a proposer that also searches the other prompts' texts


@dataclass(frozen=True)
class Walk:
    """One call's rounds under one way of proposing."""

    tokens: int
    passes: int
    nodes: int  # proposed tokens over all passes
    pass_ns: float  # the passes priced by width

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes


def prefixes(paths: Sequence[Sequence[int]]) -> set[tuple[int, ...]]:
    """The trie of paths, as the set of its nodes' root paths."""
    return {tuple(path[:depth]) for path in paths for depth in range(1, len(path) + 1)}


def accepted(nodes: set[tuple[int, ...]], future: Sequence[int]) -> int:
    """Greedy verification of a trie: the longest prefix of the target's path it holds."""
    n = 0
    while n < len(future) and tuple(future[: n + 1]) in nodes:
        n += 1
    return n


def walk(
    prompt: list[int],
    path: list[int],
    propose: Callable[[list[int]], set[tuple[int, ...]]],
    costs: Costs,
    tokens: int = MAX_NEW_TOKENS,
) -> Walk:
    """Rounds from the prompt until `tokens` of the path are committed: each proposes the
    nodes `propose` gives for the context and commits their accepted prefix and the
    target's own token."""
    done = passes = nodes = 0
    pass_ns = 0.0
    while done < tokens:
        proposal = propose(prompt + path[:done])
        done += accepted(proposal, path[done:]) + 1
        passes, nodes, pass_ns = (
            passes + 1,
            nodes + len(proposal),
            pass_ns + costs.pass_ns(len(proposal) + 1),
        )
    return Walk(tokens, passes, nodes, pass_ns)


def continuations(doc: list[int], suffix: list[int], end: int, k: int) -> Iterator[list[int]]:
    """Up to k tokens after each occurrence of suffix that starts before `end`, earliest first."""
    i = 0
    while True:
        try:
            i = doc.index(suffix[0], i, end)
        except ValueError:
            return
        if doc[i : i + len(suffix)] == suffix and i + len(suffix) < len(doc):
            yield doc[i + len(suffix) : i + len(suffix) + k]
        i += 1


def with_history(
    context: list[int],
    history: Sequence[list[int]],
    k: int,
    min_ngram: int,
    max_ngram: int,
    max_paths: int,
) -> set[tuple[int, ...]]:
    """Up to max_paths distinct continuations of the context's suffixes, in the context and
    in the other calls' texts: a longer suffix first, the context before the others."""
    paths: list[list[int]] = []
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        suffix = context[-n:]
        found = itertools.chain(
            continuations(context, suffix, len(context) - n, k),
            *(continuations(doc, suffix, len(doc), k) for doc in history),
        )
        paths += (path for path in found if path not in paths)
        if len(paths) >= max_paths:
            break
    return prefixes(paths[:max_paths])


def proposers(
    k: int, width: int, min_ngram: int, max_ngram: int, history: Sequence[list[int]]
) -> dict:
    """label -> a context's proposal, as node paths; the chain of each family first."""

    def tree(paths: int):
        return lambda context: _tree_nodes(lookup_tree(context, k, min_ngram, max_ngram, paths))

    def cached(paths: int):
        return lambda context: with_history(context, history, k, min_ngram, max_ngram, paths)

    return {
        "chain": lambda context: prefixes([lookup_continuation(context, k, min_ngram, max_ngram)]),
        f"tree w={width}": tree(width),
        "every continuation": tree(UNLIMITED),
        f"chain{HISTORY}": cached(1),
        f"tree w={width}{HISTORY}": cached(width),
        f"every continuation{HISTORY}": cached(UNLIMITED),
    }


def _tree_nodes(tree) -> set[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tree.token_ids, tree.parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return set(paths)


def ceiling(traces: dict, costs: Costs, k: int, width: int, min_ngram: int, max_ngram: int) -> dict:
    """{prompt name: {proposer: Walk}}."""
    texts = {name: trace["prompt"] + trace["path"] for name, trace in traces.items()}
    walks = {}
    for name, trace in traces.items():
        history = [text for other, text in texts.items() if other != name]
        walks[name] = {
            label: walk(trace["prompt"], trace["path"], propose, costs)
            for label, propose in proposers(k, width, min_ngram, max_ngram, history).items()
        }
    return walks


def report(walks: dict) -> str:
    """Per kind, geometric means over its prompts: each proposer's tokens per pass (mean
    nodes a pass); then its speed over its family's chain, with every width costing the
    same (tokens per pass) and priced by width."""
    labels = list(next(iter(walks.values())))
    kinds = [*sorted({kind_of(name) for name in walks}), "all"]
    rows = {
        kind: [w for name, w in walks.items() if kind in ("all", kind_of(name))] for kind in kinds
    }

    def chain(label: str) -> str:
        return "chain" + (HISTORY if label.endswith(HISTORY) else "")

    def cells(calls, label) -> tuple[str, str]:
        base = chain(label)
        return (
            f"{_geomean(c[label].tokens_per_pass for c in calls):.2f} "
            f"({statistics.mean(c[label].nodes / c[label].passes for c in calls):.1f})",
            f"{_geomean(c[label].tokens_per_pass / c[base].tokens_per_pass for c in calls):.3f} "
            f"({_geomean(c[base].pass_ns / c[label].pass_ns for c in calls):.3f})",
        )

    trees = [label for label in labels if not label.startswith("chain")]
    return "\n".join(
        [
            "Tokens per pass (nodes per pass):",
            "",
            "| kind | " + " | ".join(labels) + " |",
            "|---" * (len(labels) + 1) + "|",
            *(
                f"| {kind} | " + " | ".join(cells(rows[kind], label)[0] for label in labels) + " |"
                for kind in kinds
            ),
            "",
            "Over the chain of the same drafter: width free (priced by width):",
            "",
            "| kind | " + " | ".join(trees) + " |",
            "|---" * (len(trees) + 1) + "|",
            *(
                f"| {kind} | " + " | ".join(cells(rows[kind], label)[1] for label in trees) + " |"
                for kind in kinds
            ),
        ]
    )


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(COSTS), default="qwen")
    parser.add_argument("--k", type=int, default=8, help="the deepest proposal, in tokens")
    parser.add_argument("--width", type=int, default=4, help="paths of the drafter's bounded tree")
    parser.add_argument("--min-ngram", type=int, default=2)
    parser.add_argument("--max-ngram", type=int, default=4)
    parser.add_argument(
        "--no-padding", action="store_true", help="the target runs each width as it is"
    )
    args = parser.parse_args(argv)
    costs = dataclasses.replace(COSTS[args.pair], pad=not args.no_padding)
    walks = ceiling(
        load_traces(args.pair, "all"), costs, args.k, args.width, args.min_ngram, args.max_ngram
    )
    print(report(walks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
