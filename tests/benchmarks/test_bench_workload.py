"""The harness's pieces (benchmarks/bench_workload.py, benchmarks/common.py): the reference
runs first and hands its answers on, passes are counted as the target ran them, the
report's ratios, rates, equality counts and bound are what the runs say, repeats are
interleaved, and results are appended."""

from __future__ import annotations

import collections
import json
from types import SimpleNamespace

import pytest

from benchmarks import bench_workload as bw
from benchmarks import common
from benchmarks.common import Run
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
            return [Run(list(tokens), seconds, len(tokens)) for _ in conversation.turns]

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
    assert "2.00x [2.00-2.00], 2.0 tok/s, 1.00/pass, 8/8 equal" in overall


def test_a_differing_output_is_counted():
    results = {
        "writing/1": {
            bw.REFERENCE: [[Run([1, 2], 1.0, 2), Run([3], 1.0, 1)]],
            "other": [[Run([1, 2], 0.5, 1), Run([4], 1.0, 1)]],
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
    assert common.target_passes(stats) == passes


def test_repeats_give_every_method_each_position_and_predecessor():
    orders = {tuple(common.round_order(list("abc"), repeat)) for repeat in range(6)}
    assert len(orders) == 6
    predecessors = collections.Counter((o[i - 1], o[i]) for o in orders for i in (1, 2))
    assert set(predecessors.values()) == {2}  # each method right after each other one twice


def test_ratio_interval_is_the_geometric_mean_with_a_t_interval():
    ratio, low, high = common.ratio_interval([0.5, 0.25])
    assert ratio == pytest.approx((0.5 * 0.25) ** 0.5)
    # log ratios -ln 2 and -ln 4: mean -1.5 ln 2, standard error 0.5 ln 2, t(0.975, 1) = 12.706
    assert low == pytest.approx(2 ** (-1.5 - 0.5 * 12.7062), rel=1e-4)
    assert high == pytest.approx(2 ** (-1.5 + 0.5 * 12.7062), rel=1e-4)
    assert common.ratio_interval([2.0]) == (2.0, None, None)
    assert common.interval_text([2.0]) == "2.00x"


def test_the_bound_is_leviathans_at_the_measured_costs():
    """3 tokens a pass; a pass costs 10 ms with 2 drafted tokens of 1 ms, target-only 8 ms
    a pass: 3 * 8 / (2 * 1 + 10)."""
    runs = [Run([1] * 30, 1.0, passes=10, drafted=20, draft_seconds=0.02, target_seconds=0.1)]
    reference = [Run([1] * 30, 1.0, passes=30, target_seconds=0.24)]
    assert common.bound(runs, reference) == pytest.approx(3 * 8 / 12)
    assert common.bound(reference, reference) is None  # nothing drafted


def test_results_are_appended_beside_their_raw_runs(tmp_path):
    out = tmp_path / "r.md"
    common.write_results(out, ["# one"], {"runs": 1})
    common.write_results(out, ["# two"], {"runs": 2})
    assert out.read_text() == "# one\n# two\n"
    assert json.loads(out.with_suffix(".json").read_text()) == [{"runs": 1}, {"runs": 2}]
