"""The workload benchmark's pieces (benchmarks/bench_workload.py): the reference runs
first and hands its answers on, passes are counted as the target ran them, and the
report's ratios, rates and equality counts are what the runs say."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import bench_workload as bw
from benchmarks.workloads import Conversation

CONVERSATIONS = [
    Conversation("writing/1", "writing", ("a", "b")),
    Conversation("math/2", "math", ("c", "d")),
]


def test_the_reference_runs_first_and_its_answers_reach_the_other_methods():
    seen = []

    def method(name, tokens, seconds):
        def run(conversation, answers):
            seen.append((name, conversation.name, list(answers)))
            return [bw.Turn(list(tokens), seconds, len(tokens)) for _ in conversation.turns]

        return run

    methods = {
        "fast": method("fast", [1, 2], 1.0),
        bw.REFERENCE: method(bw.REFERENCE, [1, 2], 2.0),
    }
    results = bw.measure(methods, CONVERSATIONS, 2, lambda ids: f"text{ids}", lambda *a: None)
    first = [name for name, conversation, _ in seen if conversation == "writing/1"]
    assert first[0] == bw.REFERENCE  # repeat 0
    assert ("fast", "writing/1", ["text[1, 2]", "text[1, 2]"]) in seen
    lines = bw.report(results, CONVERSATIONS, [bw.REFERENCE, "fast"])
    overall = next(line for line in lines if line.startswith("| overall"))
    assert "2.00x, 2.0 tok/s, 1.00/pass, 8/8 equal" in overall


def test_a_differing_output_is_counted():
    results = {
        "writing/1": {
            bw.REFERENCE: [[bw.Turn([1, 2], 1.0, 2), bw.Turn([3], 1.0, 1)]],
            "other": [[bw.Turn([1, 2], 0.5, 1), bw.Turn([4], 1.0, 1)]],
        }
    }
    lines = bw.report(results, CONVERSATIONS[:1], ["other"])
    assert "1/2 equal" in lines[-1] and "1.50/pass" in lines[-1]


@pytest.mark.parametrize(
    "rounds, accepted, generated, passes",
    [(0, 0, 10, 10), (4, 6, 10, 4), (2, 3, 9, 6)],  # k = 0; all in rounds; rounds then a stretch
)
def test_target_passes(rounds, accepted, generated, passes):
    stats = SimpleNamespace(
        num_rounds=rounds, num_accepted=accepted, num_generated_tokens=generated
    )
    assert bw._target_passes(stats) == passes
