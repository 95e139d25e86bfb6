"""The harness: a workload's conversations through the services, against target-only and
Hugging Face in process: Spec-Bench's report per category (speedup, tokens/s, accepted
tokens per target pass, outputs equal to target-only) beside Leviathan's bound.

    .venv/bin/python -m benchmarks run --pair smollm2 --workload mt-bench
    .venv/bin/python -m benchmarks run --pair qwen --workload mt-bench --per-category 3
    .venv/bin/python -m benchmarks run --pair smollm2 --workload in-house --tree-width 4

Each conversation (benchmarks/workloads.py) runs as one session: turn 2 continues the
session after turn 1's answer (its KV caches reused). Methods, interleaved per
conversation (paired; repeat 0 runs target-only first, later repeats in `round_order`):
- through the services (`launcher`, loopback): target-only (k = 0, `Decode`), each of the
  pair's drafters at fixed k and adaptive (with --tree-width, the draft worker may propose
  token trees of that width);
- in process, on the target model the services load: HF `generate`, HF prompt lookup
  and, for a pair with a draft model, HF assisted generation with the same draft (its
  quantization too). A second turn's input is the conversation with target-only's first
  answer, rendered as the orchestrator renders it, so every method sees the same tokens.

A method's speedup is the geometric mean, over the conversation-turns of a category, of
its tokens/s over target-only's in the same repeat (median of repeats), with the 95%
interval; the bound is Leviathan's at the method's measured acceptance and costs
(`common.bound`). Every output is compared with target-only's, token for token.
Appends a Markdown section to --out and the raw runs to the JSON list beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import common
from benchmarks.workloads import Conversation, load
from model_runtime.loading import load_model
from specdec.v1 import common_pb2

REFERENCE = "target-only"


def services_method(stub, drafter: str, k: int, adaptive: bool, max_new_tokens: int):
    """Runs a conversation's turns as one session through the orchestrator."""

    def run_session(conversation: Conversation, answers: list[str]) -> list[common.Run]:
        turns, session = [], ""
        for text in conversation.turns:
            call = common.request(text, max_new_tokens, k, drafter, adaptive, session_id=session)
            turns.append(common.generate(stub, call, close=False))
            session = turns[-1].session_id
        stub.CloseSession(common_pb2.CloseSessionRequest(session_id=session), timeout=60)
        return turns

    return run_session


def hf_method(target, max_new_tokens: int, **generate_kwargs):
    """HF `generate` per turn, on the conversation so far with the reference's answers."""
    hf = common.hf_generate(target, max_new_tokens, **generate_kwargs)

    def run_in_process(conversation: Conversation, answers: list[str]) -> list[common.Run]:
        turns, messages = [], []
        for index, text in enumerate(conversation.turns):
            messages.append({"role": "user", "content": text})
            turns.append(hf(common.chat_ids(target.tokenizer, messages)))
            # HF does not say how many passes its speculation ran (0: not known)
            turns[-1].passes = 0 if generate_kwargs else len(turns[-1].token_ids)
            if index < len(answers):
                messages.append({"role": "assistant", "content": answers[index]})
        return turns

    return run_in_process


def methods_for(pair: common.Pair, stub, target, draft, args) -> dict:
    k, max_new = args.k, args.max_new_tokens
    methods = {REFERENCE: services_method(stub, "", 0, False, max_new)}
    for drafter in pair.drafters:
        methods[f"{drafter} k={k}"] = services_method(stub, drafter, k, False, max_new)
        methods[f"{drafter} adaptive k<={common.ADAPTIVE_MAX_K}"] = services_method(
            stub, drafter, common.ADAPTIVE_MAX_K, True, max_new
        )
    if not args.no_hf:
        methods["HF generate"] = hf_method(target, max_new)
        methods[f"HF prompt lookup k={k}"] = hf_method(target, max_new, prompt_lookup_num_tokens=k)
        if draft is not None:
            methods["HF assisted"] = hf_method(target, max_new, assistant_model=draft.model)
    if args.methods:
        wanted = args.methods.split(",")
        unknown = sorted(set(wanted) - set(methods))
        if unknown:
            raise SystemExit(f"unknown --methods {unknown}: choose from {list(methods)}")
        methods = {
            name: run for name, run in methods.items() if name in wanted or name == REFERENCE
        }
    return methods


def measure(methods: dict, conversations: list[Conversation], repeats: int, decode, log) -> dict:
    """{conversation name: {method: [[Run] per repeat]}}, methods interleaved per conversation."""
    results = {}
    for conversation in conversations:
        runs: dict[str, list[list[common.Run]]] = {name: [] for name in methods}
        answers: list[str] = []
        for repeat in range(repeats):
            order = common.round_order(list(methods), repeat)
            if repeat == 0:  # the reference first: its answers make the HF turns' inputs
                order = [REFERENCE] + [name for name in order if name != REFERENCE]
            for name in order:
                runs[name].append(methods[name](conversation, answers))
                if name == REFERENCE and repeat == 0:
                    answers = [decode(turn.token_ids) for turn in runs[name][0]]
        results[conversation.name] = runs
        log(conversation, runs)
    return results


def report(results: dict, conversations: list[Conversation], methods: list[str]) -> list[str]:
    """Per category and overall: speedup, tokens/s, tokens per target pass, outputs equal."""
    by_category: dict[str, list[str]] = {}
    for conversation in conversations:
        by_category.setdefault(conversation.category, []).append(conversation.name)
    by_category["overall"] = [c.name for c in conversations]
    lines = [
        "| category | " + " | ".join(methods) + " |",
        "|---|" + "---|" * len(methods),
    ]
    for category, names in by_category.items():
        cells = [_cell(results, names, method) for method in methods]
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    return lines


def _cell(results: dict, names: list[str], method: str) -> str:
    ratios, rates, per_pass, equal = [], [], [], 0
    mine_all, theirs_all = [], []
    for name in names:
        runs, reference = results[name][method], results[name][REFERENCE]
        for turn in range(len(runs[0])):
            mine = [repeat[turn] for repeat in runs]
            theirs = [repeat[turn] for repeat in reference]
            paired = [
                m.tokens_per_s / r.tokens_per_s for m, r in zip(mine, theirs) if r.tokens_per_s
            ]
            ratios.append(statistics.median(paired))
            rates.append(statistics.median(m.tokens_per_s for m in mine))
            passes = sum(m.passes for m in mine)
            if passes:
                per_pass.append(sum(len(m.token_ids) for m in mine) / passes)
            equal += sum(m.token_ids == theirs[0].token_ids for m in mine)
            mine_all += mine
            theirs_all += theirs
    tokens_per_pass = f"{statistics.fmean(per_pass):.2f}/pass" if per_pass else "-/pass"
    seconds = sum(m.seconds for m in mine_all)
    draft = sum(m.draft_seconds for m in mine_all)
    target = sum(m.target_seconds for m in mine_all)
    shares = f", draft {draft / seconds:.0%} target {target / seconds:.0%}" if target else ""
    limit = common.bound(mine_all, theirs_all)
    return (
        f"{common.interval_text(ratios)}, {statistics.fmean(rates):.1f} tok/s, {tokens_per_pass}, "
        f"{equal}/{len(mine_all)} equal{shares}" + (f", bound {limit:.2f}x" if limit else "")
    )


def _raw(results: dict) -> dict:
    return {
        name: {m: [[dataclasses.asdict(t) for t in r] for r in rs] for m, rs in runs.items()}
        for name, runs in results.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks run", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--pair", choices=sorted(common.PAIRS), default="smollm2")
    parser.add_argument("--workload", default="mt-bench", help="mt-bench or in-house")
    parser.add_argument("--per-category", type=int, default=0, help="0 = every conversation")
    parser.add_argument("--turns", type=int, default=0, help="0 = every turn")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--k", type=int, default=4, help="the fixed-k methods' k")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target-dtype", default="float32")
    parser.add_argument("--target-row-invariant", default="auto")
    parser.add_argument("--tree-width", type=int, default=None, help="the draft worker's")
    parser.add_argument("--no-hf", action="store_true", help="no in-process HF baselines")
    parser.add_argument(
        "--methods", default="", help="comma-separated subset (target-only always runs)"
    )
    parser.add_argument("--out", default="", help="default: results/<workload>_<pair>.md")
    args = parser.parse_args(argv)
    command = shlex.join(argv if argv is not None else sys.argv[1:])
    pair = common.PAIRS[args.pair]
    out = Path(args.out or common.RESULTS / f"{args.workload.replace('-', '')}_{args.pair}.md")
    conversations = load(args.workload, args.per_category, args.turns)
    torch.set_num_threads(args.threads)
    target = load_model(pair.target, dtype=args.target_dtype)
    draft = None
    if pair.draft and not args.no_hf:
        draft = load_model(pair.draft, quantize=pair.quantization)

    def detokenize(ids: list[int]) -> str:
        return target.tokenizer.decode(ids, skip_special_tokens=True)

    started = time.monotonic()
    done: dict = {}  # written as it goes: a long run cut off keeps what it measured
    partial = out.with_suffix(".partial.json")

    def keep(conversation, runs):
        lengths = {name: [len(t.token_ids) for t in r[0]] for name, r in runs.items()}
        print(conversation.name, lengths, flush=True)
        done[conversation.name] = runs
        partial.write_text(json.dumps({"command": command, "runs": _raw(done)}))

    with common.services(
        **pair.launcher_options() | {"drafter": pair.drafters[-1]},
        target_dtype=args.target_dtype,
        target_row_invariant=args.target_row_invariant,
        draft_tree_width=args.tree_width,
        threads=args.threads,
    ) as stub:
        methods = methods_for(pair, stub, target, draft, args)
        results = measure(methods, conversations, args.repeats, detokenize, keep)
    drafted = f"draft {pair.draft} ({pair.quantization})" if pair.draft else "n-gram drafter"
    lines = common.section(
        f"{args.workload}: {pair.target}, {drafted}",
        "run",
        argv,
        f"{args.threads} torch threads per worker and in process. Target {args.target_dtype}, "
        f"row invariance {args.target_row_invariant}, tree width {args.tree_width or 'default'}. "
        f"{len(conversations)} conversations ({sum(len(c.turns) for c in conversations)} turns), "
        f"greedy, at most {args.max_new_tokens} new tokens a turn, {args.repeats} repeat(s); "
        f"{time.monotonic() - started:.0f} s.",
    )
    lines += [
        "Each cell: speedup over target-only through the services (geometric mean over the "
        "category's turns, in brackets its 95% interval), tokens/s, tokens per target pass, "
        "outputs equal to target-only; through the services, the share of wall time spent "
        "drafting and in the target's compute, and Leviathan's bound at the measured "
        "acceptance and costs.",
        "",
        *report(results, conversations, list(methods)),
    ]
    common.write_results(out, lines, {"command": command, "runs": _raw(results)})
    partial.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
