"""The lookup-tree ceiling (benchmarks/tree_ceiling.py): rounds walked over a recorded
path, each proposal accepted up to its first token off the path, checked by hand."""

from __future__ import annotations

from benchmarks.replay_policy import Costs
from benchmarks.tree_ceiling import HISTORY, accepted, ceiling, prefixes, proposers, report, walk

FLAT = Costs((10.0,) * 12, draft_ms=0.0, round_trip_ms=0.0, pad=False)  # every pass 10 ms
# "1 2 3" is followed by 10 11 first and by 20 21 later: the path takes the second.
PROMPT = [1, 2, 3, 10, 11, 7, 1, 2, 3, 20, 21, 8, 1, 2, 3]
PATH = [20, 21, 8] + list(range(100, 200))


def test_a_trie_accepts_the_longest_prefix_of_the_path_it_holds():
    nodes = prefixes([[20, 21, 9], [10, 11]])
    assert accepted(nodes, [20, 21, 8, 4]) == 2
    assert accepted(nodes, [10, 11, 12]) == 2
    assert accepted(nodes, [30]) == 0 and accepted(set(), [20]) == 0


def test_a_tree_keeps_the_continuation_the_chain_drops():
    propose = proposers(k=3, width=4, min_ngram=2, max_ngram=3, history=[])
    assert accepted(propose["chain"](PROMPT), PATH) == 0  # the earliest match: 10 11 7
    assert accepted(propose["tree w=4"](PROMPT), PATH) == 3
    assert accepted(propose["every continuation"](PROMPT), PATH) == 3


def test_only_the_history_family_searches_the_other_calls():
    other = [5, 6, 40, 41, 42]
    propose = proposers(k=3, width=4, min_ngram=2, max_ngram=2, history=[other])
    assert propose["chain"]([9, 5, 6]) == set()
    assert propose[f"chain{HISTORY}"]([9, 5, 6]) == prefixes([[40, 41, 42]])
    # the context's own continuation comes first, the other calls' after it
    assert propose[f"chain{HISTORY}"]([5, 6, 50, 5, 6]) == prefixes([[50, 5, 6]])
    assert propose[f"tree w=4{HISTORY}"]([5, 6, 50, 5, 6]) == prefixes([[50, 5, 6], [40, 41, 42]])


def test_a_walk_counts_a_pass_per_round_and_prices_its_width():
    def right(k):  # always the path's next k tokens
        return lambda context: prefixes([PATH[len(context) - len(PROMPT) :][:k]])

    result = walk(PROMPT, PATH, right(3), FLAT, tokens=64)
    assert (result.passes, result.nodes) == (16, 48)  # 4 tokens a pass
    assert result.pass_ns == 16 * 10e6
    assert walk(PROMPT, PATH, lambda context: set(), FLAT, tokens=64).passes == 64


def test_the_report_compares_each_tree_with_its_own_familys_chain():
    traces = {
        "chat/0": {"prompt": PROMPT, "path": PATH},
        "summary/0": {"prompt": PROMPT, "path": PATH},
    }
    walks = ceiling(traces, FLAT, k=3, width=4, min_ngram=2, max_ngram=3)
    text = report(walks)
    assert "| chat |" in text and "| summary |" in text and "| all |" in text
    first = walks["chat/0"]
    assert first["tree w=4"].tokens_per_pass > first["chain"].tokens_per_pass
