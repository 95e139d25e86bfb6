"""python -m planner COSTS.json [--objective tpot-p90-ms=X | ttft-p90-ms=X | tokens-per-s]
    [--targets N] [--fleet 1,10,100,1000] [--kustomize-patch PATH] [--gpu PAIR]
python -m planner --traces SPANS.jsonl [...] --one-way-ms MS --prompt-tokens N
    --new-tokens N [--write-costs PATH] [the options above]

What a draft pool buys, from measured costs (planner/costs.py): the fleet model run over
layouts and speculation settings (planner/plan.py), then the draft-to-target ratio, the
speculation setting, the link delay past which a remote draft stops paying and the
expected goodput, each beside the inputs it used. docs/capacity.md explains the model.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from planner import autoscaler
from planner.costs import Costs, Request
from planner.fleet import Layout
from planner.gpu_costs import MEASURED, PAIRS, draft_hardware, with_gpu_costs
from planner.measured import costs_from_traces
from planner.plan import (
    LONGEST_DELAY_MS,
    Evaluation,
    Objective,
    Plan,
    Search,
    drafts_for,
    make_plan,
    targets_needed,
)
from speculative.estimator import round_speedup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m planner", description=__doc__.split("\n\n")[1])
    parser.add_argument(
        "costs", nargs="?", default=None, help="the costs file (JSON, planner/costs.py)"
    )
    parser.add_argument(
        "--traces",
        nargs="+",
        default=None,
        metavar="PATH",
        help="instead of COSTS: the services' span files (JSON lines, planner/measured.py)",
    )
    parser.add_argument(
        "--one-way-ms", type=float, default=None, help="with --traces: the link's one-way delay"
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=None, help="with --traces: a request's"
    )
    parser.add_argument("--new-tokens", type=int, default=None, help="with --traces: a request's")
    parser.add_argument(
        "--rate-per-s", type=float, default=0.0, help="with --traces: arrivals over the fleet"
    )
    parser.add_argument("--write-costs", default=None, help="save the costs used here (JSON)")
    parser.add_argument(
        "--objective",
        default="tokens-per-s",
        help="tpot-p90-ms=X, ttft-p90-ms=X or tokens-per-s (default)",
    )
    parser.add_argument(
        "--targets",
        type=int,
        default=None,
        help="target workers in the fleet (default: enough for the file's arrival rate)",
    )
    parser.add_argument("--workload", default=None, help="the file's workload (default: its first)")
    parser.add_argument(
        "--gpu",
        choices=sorted([*PAIRS, MEASURED]),
        default=None,
        help="replace the file's pass costs by a GPU pair's (planner/gpu_costs.py)",
    )
    parser.add_argument("--fleet", default="", help="fleet sizes for a table, e.g. 1,10,100,1000")
    parser.add_argument(
        "--kustomize-patch", default=None, help="write the HPAs' replica bounds here"
    )
    defaults = Search()
    parser.add_argument("--requests", type=int, default=defaults.requests, help="a simulation's")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="bisection steps")
    parser.add_argument(
        "--ks", default=",".join(map(str, defaults.ks)), help="fixed k tried beside adaptive"
    )
    parser.add_argument(
        "--ratios",
        default=",".join(f"{d}:{t}" for d, t in defaults.ratios),
        help="draft:target workers of a remote pool tried",
    )
    parser.add_argument("--jobs", type=int, default=defaults.jobs, help="processes")
    args = parser.parse_args(argv)
    _check_inputs(parser, args)
    path = args.costs or f"--traces {' '.join(args.traces)}"
    try:
        objective = Objective.parse(args.objective)
        costs = _costs(args)
        costs = with_gpu_costs(costs, args.gpu) if args.gpu else costs
        if args.write_costs:
            costs.save(args.write_costs)
        search = Search(
            requests=args.requests,
            seed=args.seed,
            steps=args.steps,
            ks=tuple(int(k) for k in args.ks.split(",") if k),
            ratios=tuple(_ratio(r) for r in args.ratios.split(",") if r),
            tolerance=defaults.tolerance,
            jobs=args.jobs,
        )
        plan = make_plan(costs, objective, search, args.workload)
    except (OSError, ValueError, KeyError) as error:
        parser.error(str(error))
    targets = args.targets or max(
        1, targets_needed(costs.arrivals.rate_per_s, plan.chosen.goodput_per_s)
    )
    print(render(plan, costs, search, path, args.gpu, targets))
    if args.fleet:
        sizes = [int(n) for n in args.fleet.split(",") if n]
        print(fleet_table(plan, sizes, args.gpu))
    if args.kustomize_patch:
        text = kustomize_patch(plan, costs, targets, path)
        Path(args.kustomize_patch).write_text(text)
        print(f"\nwrote {args.kustomize_patch}")
    if args.write_costs:
        print(f"\nwrote {args.write_costs}")
    return 0


def _check_inputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exactly one of COSTS and --traces; with --traces, what spans do not tell."""
    if (args.costs is None) == (args.traces is None):
        parser.error("give exactly one of COSTS (a costs file) and --traces PATH [PATH ...]")
    given = {
        "--one-way-ms": args.one_way_ms,
        "--prompt-tokens": args.prompt_tokens,
        "--new-tokens": args.new_tokens,
    }
    if args.traces is not None:
        missing = [flag for flag, value in given.items() if value is None]
        if missing:
            parser.error(f"--traces needs {', '.join(missing)} (not in the spans)")
    elif any(value is not None for value in given.values()) or args.rate_per_s:
        parser.error("--one-way-ms, --prompt-tokens, --new-tokens, --rate-per-s go with --traces")


def _costs(args: argparse.Namespace) -> Costs:
    """The costs file, or the costs fitted from the traces."""
    if args.costs is not None:
        return Costs.load(args.costs)
    return costs_from_traces(
        args.traces,
        one_way_ms=args.one_way_ms,
        request=Request(args.prompt_tokens, args.new_tokens, "--prompt-tokens, --new-tokens"),
        rate_per_s=args.rate_per_s,
    )


def _ratio(text: str) -> tuple[int, int]:
    drafts, _, targets = text.partition(":")
    return int(drafts), int(targets)


# --- the report ---------------------------------------------------------------------------


def render(
    plan: Plan, costs: Costs, search: Search, path: str, gpu: str | None, targets: int
) -> str:
    chosen = plan.chosen
    lines = [
        f"# Capacity plan: {path}, workload {plan.workload}, objective {plan.objective.label}",
        "",
        "## Inputs",
        "",
        *inputs(costs, plan.workload, gpu),
        f"- search: {search.requests} requests a simulation (a fifth warm up), seed "
        f"{search.seed}, fixed k {list(search.ks)} and adaptive, remote ratios "
        f"{[f'{d}:{t}' for d, t in search.ratios]}",
        "- assumptions: a fleet is independent cells (a cell: its targets and draft workers, "
        "its share of the Poisson arrivals, least-loaded routing); no drafting ahead, trees "
        "or early stops (docs/capacity.md)",
        "",
        "## Configurations",
        "",
        "| configuration | saturation (req/s a target) | tokens/s a target there | tokens a "
        "round (sim / E[k]) | Leviathan's bound, one session | goodput (req/s a target) "
        "| TPOT p50 / p90 (ms) | TTFT p90 (ms) | queue | draft busy |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(_row(e, costs, plan.workload) for e in plan.evaluations),
        "",
        "## Plan",
        "",
        f"- layout: {_layout(chosen)}",
        f"- speculation: {chosen.speculation.label}",
        f"- goodput: {chosen.goodput_per_s:.2f} requests/s a target at {plan.objective.label} "
        f"({chosen.goodput_per_s * costs.request.new_tokens:.0f} tokens/s), "
        f"{chosen.goodput_per_s * targets:.1f} requests/s over {targets} targets; "
        f"target-only {plan.target_only.goodput_per_s:.2f}, co-located best "
        f"{plan.colocated.goodput_per_s:.2f} ({plan.colocated.speculation.label}), remote best "
        f"{plan.remote.goodput_per_s:.2f} ({_layout(plan.remote)}, "
        f"{plan.remote.speculation.label})",
        f"- remote draft pool: {_break_even(plan, costs)}",
        f"- at the file's arrival rate ({costs.arrivals.rate_per_s:g} requests/s): "
        f"{_needed(costs, chosen)}",
    ]
    return "\n".join(lines)


def inputs(costs: Costs, workload: str, gpu: str | None) -> list[str]:
    t, d, a, link = costs.target, costs.draft, costs.acceptance(workload), costs.link
    by_batch = ", ".join(f"{ms:.3g} ms at {b}" for b, ms in d.ms_by_batch)
    colocated = ", ".join(f"{ms:.3g} ms at {b}" for b, ms in d.colocated_ms_by_batch)
    delays = link.one_way_ms
    return [
        f"- target pass: {t.base_ms:.4g} ms + {t.per_token_ms:.4g} ms a token + "
        f"{t.per_row_ms:.4g} ms a session, floor {t.compute_per_token_ms:.4g} ms a token; "
        f"{t.max_sessions} sessions a worker"
        + (f", {t.max_batch_tokens} tokens a pass" if t.max_batch_tokens else "")
        + f" (source: {t.source or 'not given'}{'; --gpu ' + gpu if gpu else ''})",
        f"- draft step: {by_batch}"
        + (f"; co-located: {colocated}" if colocated else "")
        + f"; prefill {d.prefill_token_ms:.4g} ms a token (source: {d.source or 'not given'})",
        f"- acceptance ({workload}): a_i = {', '.join(f'{p:.3f}' for p in a.by_position)} "
        f"(source: {a.source or 'not given'})",
        f"- link: one-way {delays[0]:g} ms"
        + (f" ({len(delays)} samples, median {link.median_ms:g} ms)" if len(delays) > 1 else "")
        + f"; local {link.local_one_way_ms:g} ms; round overhead {link.round_overhead_ms:g} ms "
        f"(source: {link.source or 'not given'})",
        f"- arrivals: {costs.arrivals.rate_per_s:g} requests/s over the fleet, Poisson "
        f"(source: {costs.arrivals.source or 'not given'})",
        f"- request: {costs.request.prompt_tokens} prompt tokens, {costs.request.new_tokens} "
        f"new tokens (source: {costs.request.source or 'not given'})",
    ]


def _row(e: Evaluation, costs: Costs, workload: str) -> str:
    sat, at = e.saturation, e.at_goodput
    k = e.speculation.k
    expected = costs.acceptance(workload).expected_tokens(k) if k is not None else None
    rounds = f"{sat.tokens_per_round:.2f}" + (
        f" / {expected:.2f}"
        if expected
        else f" (k {sat.drafted_per_round:.1f}, {sat.stretch_share:.0%} decoded alone)"
    )
    if at is None:
        latency = "- | - | -"
    elif at.overloaded:  # tokens-per-s: the run at saturation, its queue growing
        latency = f"{at.tpot_p50_ms:.1f} / {at.tpot_p90_ms:.1f} | grows | grows"
    else:
        latency = (
            f"{at.tpot_p50_ms:.1f} / {at.tpot_p90_ms:.1f} | {at.ttft_p90_ms:.0f} | "
            f"{at.mean_queue:.2f}"
        )
    return (
        f"| {e.label} | {sat.rate_per_s:.2f} | {sat.tokens_per_s:.0f} | {rounds} | "
        f"{_bound(e, costs, workload)} | {e.goodput_per_s:.2f} | {latency} | "
        f"{at.draft_busy if at is not None else sat.draft_busy:.2f} |"
    )


def _bound(e: Evaluation, costs: Costs, workload: str) -> str:
    """Leviathan's bound on the speedup of one session alone at this k (round_speedup at
    the position acceptance's E[tokens], no delay): what no scheduling of rounds beats."""
    k = e.speculation.k
    if k is None or e.cell.layout is Layout.TARGET_ONLY:
        return "-"
    colocated = e.cell.layout is Layout.COLOCATED
    one_pass = costs.target.pass_ms(1, 1)
    speedup = round_speedup(
        costs.acceptance(workload).expected_tokens(k),
        k,
        costs.draft.step_ms(1, colocated),
        one_pass,
        costs.target.pass_ms(1, k + 1),
    )
    return f"{speedup:.2f}x"


def _layout(e: Evaluation) -> str:
    cell = e.cell
    if cell.layout is Layout.REMOTE:
        return (
            f"remote draft pool, {cell.drafts} draft worker(s) to {cell.targets} target(s) "
            f"({cell.ratio:.3g} a target)"
        )
    if cell.layout is Layout.COLOCATED:
        return "draft co-located on each target worker (no draft pool)"
    return "target-only (no draft)"


def _break_even(plan: Plan, costs: Costs) -> str:
    local = plan.local
    rival = f"{local.goodput_per_s:.2f} requests/s a target ({local.label})"
    delay = plan.break_even_delay_ms
    if delay is None:
        return f"does not reach {rival} even at no link delay"
    if math.isinf(delay):
        return f"reaches {rival} at every one-way delay up to {LONGEST_DELAY_MS:g} ms"
    text = (
        f"stops paying past {delay:.2f} ms one-way (the file's link: "
        f"{costs.link.median_ms:g} ms): there it no longer serves {rival} within the objective"
    )
    if plan.chosen is plan.local and delay >= costs.link.median_ms:
        text += f"; at the file's link it gains less than the tie margin, so the plan keeps {local.label}"
    return text


def _needed(costs: Costs, chosen: Evaluation) -> str:
    needed = targets_needed(costs.arrivals.rate_per_s, chosen.goodput_per_s)
    if not needed:
        return "the objective is not met at any rate"
    drafts = drafts_for(needed, chosen)
    return f"{needed} target workers" + (f" and {drafts} draft workers" if drafts else "")


# --- the fleet table and the autoscaler patch ---------------------------------------------


def fleet_table(plan: Plan, sizes: list[int], gpu: str | None) -> str:
    """Per fleet size: the draft workers of the chosen layout (at least one), the ratio
    that gives, the goodput (cells of the ratio evaluated at or below it)."""
    chosen = plan.chosen
    lines = [
        "",
        "## Fleet",
        "",
        "| targets | draft workers | drafts a target | goodput (requests/s) | draft hardware a target node |",
        "|---|---|---|---|---|",
    ]
    for targets in sizes:
        drafts = drafts_for(targets, chosen)
        if chosen.cell.layout is Layout.REMOTE:
            ratio = drafts / targets
            cell = max(
                (e for e in plan.remote_by_ratio if e.cell.ratio <= ratio + 1e-9),
                key=lambda e: e.cell.ratio,
            )
            goodput, hardware = cell.goodput_per_s, f"{ratio:.3g} x {draft_hardware(gpu)}"
        else:
            goodput, hardware = chosen.goodput_per_s, "none (drafts on the target)"
            if chosen.cell.layout is Layout.TARGET_ONLY:
                hardware = "none (no draft)"
        lines.append(
            f"| {targets} | {drafts} | {drafts / targets:.3g} | {goodput * targets:.1f} | {hardware} |"
        )
    return "\n".join(lines)


def kustomize_patch(plan: Plan, costs: Costs, targets: int, path: str) -> str:
    chosen = plan.chosen
    needed = min(targets, max(1, targets_needed(costs.arrivals.rate_per_s, chosen.goodput_per_s)))
    target = autoscaler.Bounds(
        needed,
        max(targets, needed),
        f"{needed} serve the file's {costs.arrivals.rate_per_s:g} requests/s at "
        f"{chosen.goodput_per_s:.2f} a target; at most the fleet's {targets}",
    )
    if chosen.cell.layout is Layout.REMOTE:
        draft = autoscaler.Bounds(
            drafts_for(needed, chosen),
            drafts_for(targets, chosen),
            f"{chosen.cell.ratio:.3g} draft workers a target ({chosen.speculation.label})",
        )
    else:
        draft = autoscaler.Bounds(1, 1, f"{_layout(chosen)}: the pool is not used")
    header = (
        f"Written by `python -m planner {path} --objective {plan.objective.label} "
        f"--targets {targets}` (docs/capacity.md).\n"
        f"{_layout(chosen)}; {chosen.speculation.label}; workload {plan.workload}."
    )
    return autoscaler.patch(target, draft, header)


if __name__ == "__main__":
    sys.exit(main())
