"""`python -m benchmarks SCENARIO [ARGS]`: the harness and its scenarios, one entry point.

Each scenario is a module of this package with a `main(argv)` (also runnable as
`python -m benchmarks.MODULE`); `python -m benchmarks SCENARIO --help` shows its options.
Results and their index: benchmarks/results/README.md.
"""

from __future__ import annotations

import importlib
import sys

SCENARIOS = {  # name: (module, what it measures)
    "run": ("bench_workload", "the harness: a workload through every method, paired, with bounds"),
    "load": ("bench_load", "throughput and latency under concurrent sessions"),
    "capacity": ("bench_capacity", "what a draft pool buys a target core, beside the fleet model"),
    "link": ("bench_link", "stretches and draft_stop across a delayed link, pinned cores"),
    "failover": ("bench_failover", "a client's stall when the serving worker is killed"),
    "startup": ("bench_startup", "cold start: each role to serving, first token, make run"),
    "rows": ("bench_row_invariance", "what row invariance costs and buys, per precision"),
    "gpu": ("gpu_check", "the GPU check (--smoke: the same steps on a CPU)"),
    "replay": ("replay_policy", "adaptive k against every fixed k over recorded traces"),
}


def main(argv: list[str]) -> int:
    wanted = argv[0] if argv else ""
    if wanted not in SCENARIOS:
        asked = wanted in ("-h", "--help")
        lines = [__doc__.splitlines()[0], "", "scenarios:"]
        lines += [f"  {name:<9} {what} ({module}.py)" for name, (module, what) in SCENARIOS.items()]
        lines += [] if asked or not wanted else ["", f"no scenario {wanted!r}"]
        print("\n".join(lines), file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    module = importlib.import_module(f"benchmarks.{SCENARIOS[wanted][0]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
