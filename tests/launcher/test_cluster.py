"""launcher.cluster: --cpus parsing and a process pinned as its pool says."""

from __future__ import annotations

import argparse
import os

import pytest

from launcher.cluster import Cluster, parse_args, parse_cpus, pool_cpus


def test_parse_cpus_reads_taskset_lists():
    assert parse_cpus("target=0") == ("target", frozenset({0}))
    assert parse_cpus("draft=1-3,6") == ("draft", frozenset({1, 2, 3, 6}))


@pytest.mark.parametrize("text", ["0", "target=", "target=a", "=1", "target=-1", "draft=3-x"])
def test_parse_cpus_rejects_malformed_text(text):
    with pytest.raises(argparse.ArgumentTypeError, match="POOL=LIST"):
        parse_cpus(text)


def test_pool_cpus_by_pool_the_last_flag_wins():
    args = parse_args(["--cpus", "target=0", "--cpus", "draft=1", "--cpus", "target=1"])
    assert pool_cpus(args, "target") == frozenset({1})
    assert pool_cpus(args, "draft") == frozenset({1})
    assert pool_cpus(args, "orchestrator") is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_a_pinned_process_runs_only_on_its_cores(tmp_path, monkeypatch):
    """A real child started by Cluster.start reports its own affinity: the core it was given."""
    core = max(os.sched_getaffinity(0))
    (tmp_path / "affinity_probe.py").write_text(
        "import os\nprint(sorted(os.sched_getaffinity(0)), flush=True)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    cluster = Cluster(tmp_path / "logs")
    cluster.start("probe", "affinity_probe", [], frozenset({core}))
    cluster.processes[-1][1].wait(timeout=60)
    assert (tmp_path / "logs" / "probe.log").read_text().strip() == str([core])
