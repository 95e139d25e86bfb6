"""Link: do stretches and draft_stop pay where they are meant to, across a link between
draft and target? Each switched off against the draft worker's defaults, through the services.

    .venv/bin/python -m benchmarks link --pair smollm2          # n-gram drafter
    .venv/bin/python -m benchmarks link --pair qwen --repeats 1 # ngram+model, 0.5B int8
    .venv/bin/python -m benchmarks link --pair tiny --delays 1 --prompts chat \\
        --max-new-tokens 8 --repeats 1 --out /tmp/link.md     # checks the script

The target worker pinned to CPU 1 behind a delaying TCP proxy (benchmarks/delay_proxy.py;
one-way delay 1, 5 and 20 ms), every draft worker and orchestrator on CPU 0, one torch
thread each, as on two machines. Per delay one system: draft workers with the defaults
("all on"), with `--disable stretches`, and (a pair with a draft model) with `--disable
draft_stop`, each behind its own orchestrator. Adaptive k <= 8, greedy, chat template, a
new session per call; variants interleaved per prompt in `round_order`. Cells: decoding
tokens/s (prefill left out) of all on, and each switch over all on in the same repeat
(geometric mean, 95% interval). Appends a section per delay to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks import common
from benchmarks.delay_proxy import delayed
from benchmarks.prompts import PROMPTS
from launcher.cluster import Cluster, Role, free_port
from service_common.server import channel
from specdec.v1 import orchestrator_pb2_grpc

BASE = "all on"
DRAFT_CPU, TARGET_CPU = 0, 1


def variants(pair: common.Pair, only: str = "") -> dict[str, list[str]]:
    """Draft workers by name: their flags (only: a comma-separated subset beside all on)."""
    extra = ["--quantization", pair.quantization] if pair.draft else []
    out = {BASE: extra, "stretches off": [*extra, "--disable", "stretches"]}
    if pair.draft:  # draft_stop acts on a model drafter only
        out["draft_stop off"] = [*extra, "--disable", "draft_stop"]
    if unknown := set(only.split(",")) - set(out) - {""}:
        raise SystemExit(f"no such variant {sorted(unknown)}; there are {list(out)}")
    return {
        name: flags for name, flags in out.items() if not only or name in (BASE, *only.split(","))
    }


def pinned_system(
    pair: common.Pair, delay_ms: float, table: dict[str, list[str]], cluster: Cluster
):
    """Starts the target (CPU 1) behind a delay proxy and, per variant, a draft worker with
    its flags and an orchestrator (CPU 0); returns the orchestrators' stubs by variant."""
    os.sched_setaffinity(0, {DRAFT_CPU})
    address = f"127.0.0.1:{free_port()}"
    flags = ["--model", pair.target, "--address", address, "--threads", "1"]
    target = Role("target", "target", "target_service", flags, address)
    roles = delayed([target], delay_ms)  # the proxy, then the target (its address the proxy's)
    orchestrators = {}
    for name, extra in table.items():
        draft, orchestrator = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        flags = ["--model", pair.draft, "--address", draft, "--threads", "1", *extra]
        roles.append(Role(f"draft-{name}", "draft", "draft_service", flags, draft))
        flags = ["--address", orchestrator, "--target-addresses", target.address]
        flags += ["--draft-addresses", draft]
        orchestrators[name] = Role(
            f"orchestrator-{name}", "orchestrator", "orchestrator", flags, orchestrator
        )
    for role in [*roles, *orchestrators.values()]:
        cpu = TARGET_CPU if role.pool == "target" else DRAFT_CPU
        cluster.start(role.name, role.module, role.args, frozenset({cpu}))  # threads inherit it
        if role.pool in ("target", "draft"):
            cluster.wait_healthy(role.name, role.address, 1800.0)
    for role in orchestrators.values():
        cluster.wait_healthy(role.name, role.address, 1800.0)
    stub = orchestrator_pb2_grpc.OrchestratorStub
    return {name: stub(channel(role.address, None)) for name, role in orchestrators.items()}


def measure_link(pair: common.Pair, drafter: str, delay_ms: float, args) -> tuple[dict, int, int]:
    """({(prompt, variant): [decoding tokens/s per repeat]}, outputs unlike the prompt's
    first, outputs)."""
    table, rates, mismatches, runs = variants(pair, args.variants), {}, 0, 0
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="bench-link-")))
    try:
        stubs = pinned_system(pair, delay_ms, table, cluster)
        for name in table:  # warm-up
            common.generate(
                stubs[name],
                common.request("Hello!", 8, common.ADAPTIVE_MAX_K, drafter, True, pair.chat),
            )
        for prompt in args.prompts.split(","):
            call = common.request(
                PROMPTS[prompt],
                args.max_new_tokens,
                common.ADAPTIVE_MAX_K,
                drafter,
                True,
                pair.chat,
            )
            outputs = []
            for repeat in range(args.repeats):
                for name in common.round_order(list(table), repeat):
                    run = common.generate(stubs[name], call)
                    rate = len(run.token_ids) / max(1e-9, run.seconds - run.prefill_seconds)
                    rates.setdefault((prompt, name), []).append(rate)
                    outputs.append(run.token_ids)
                    print(
                        f"+{delay_ms:g} ms {prompt} {name} #{repeat}: {rate:.2f} tok/s", flush=True
                    )
            mismatches += sum(o != outputs[0] for o in outputs)
            runs += len(outputs)
    finally:
        cluster.stop()
    return rates, mismatches, runs


def link_table(names: list[str], rates: dict) -> list[str]:
    prompts = list(dict.fromkeys(prompt for prompt, _ in rates))
    lines = ["| prompt | " + " | ".join(names) + " |", "|---" * (1 + len(names)) + "|"]
    overall: dict[str, list[float]] = {name: [] for name in names[1:]}
    for prompt in prompts:
        base = rates[prompt, BASE]
        cells = [f"{statistics.median(base):.2f} tok/s"]
        for name in names[1:]:
            ratios = [m / b for m, b in zip(rates[prompt, name], base)]
            overall[name] += ratios
            cells.append(common.interval_text(ratios))
        lines.append(f"| {prompt} | " + " | ".join(cells) + " |")
    means = " | ".join(common.interval_text(ratios) for ratios in overall.values())
    return [*lines, f"| geometric mean | | {means} |"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks link", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--pair", choices=sorted(common.PAIRS), default="smollm2")
    parser.add_argument("--drafter", default="", help="default: the pair's last (ngram+model)")
    parser.add_argument("--delays", default="1,5,20", help="one-way delays in ms")
    parser.add_argument("--prompts", default=",".join(PROMPTS))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variants", default="", help='e.g. "draft_stop off" (default: all)')
    parser.add_argument("--out", default="", help="default: results/link_<pair>.md")
    args = parser.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 CPUs: the draft side on one, the target on the other")
    pair = common.PAIRS[args.pair]
    drafter = args.drafter or pair.drafters[-1]
    failed = 0
    for delay in [float(d) for d in args.delays.split(",")]:
        rates, mismatches, runs = measure_link(pair, drafter, delay, args)
        failed += mismatches
        lines = common.section(
            f"Stretches and draft_stop across a link, {args.pair} ({drafter}), +{delay:g} ms "
            "one way",
            "link",
            argv,
            f"Target pinned to one core behind a delay proxy, draft and orchestrators on the "
            f"other, one torch thread each. Adaptive k <= {common.ADAPTIVE_MAX_K}, greedy, "
            f"{args.max_new_tokens} new tokens, {args.repeats} interleaved repeat(s). Cells: "
            f"decoding tokens/s of {BASE} (median), and each switch over {BASE} in the same "
            f"repeat (geometric mean, 95% interval). Outputs that differ from the prompt's "
            f"first output: {mismatches} of {runs}.",
        )
        names = list(variants(pair, args.variants))
        common.write_results(
            args.out or common.RESULTS / f"link_{args.pair}.md", [*lines, *link_table(names, rates)]
        )
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
