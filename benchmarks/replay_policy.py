"""Adaptive k against every fixed k, replayed without timing noise: the real round loop
(speculative.speculation_loop, its policy, estimator and stretches) over recorded greedy
traces, in virtual time, at pass costs given as numbers. Where adaptive loses to a fixed k
here, its rule is at fault, not the machine's noise.

    .venv/bin/python -m benchmarks replay record --pair smollm2   # traces (minutes)
    .venv/bin/python -m benchmarks replay --pair smollm2          # the replay (seconds)
    .venv/bin/python -m benchmarks replay --pair qwen --shifts 8  # each call started 0-7 tokens later
    .venv/bin/python -m benchmarks replay --pair qwen --prompt-set all --cascade  # cascade vs its parts

`record` decodes each prompt kind greedily with the pair's target (chat template) and,
for a pair with a draft model, at every position the draft's greedy continuation of
MAX_K tokens from the target's own prefix (the draft quantized as the pair's). The replay
then knows every verdict: a proposal is accepted up to its first token off the target's
path. The drafters are the real ones where they cost nothing to run (prompt lookup, and
the cascade's lookup half); the model draft is its recorded continuation.

Virtual time: a draft token costs d, a target pass over w tokens the calibrated cost of
the width the worker runs it at (model_runtime/width_padding), times a seeded log-normal
jitter (`--jitter`); a round adds the round trip R, a stretch R once. Draft and target
take turns (no drafting ahead), as the launcher runs a model draft on a shared host.
Each adaptive call is seeded with what the call before it (another prompt) measured, as
a draft worker seeds it. Costs default to the pair's as measured on the development
machine (benchmarks/results/archive/results_width_padding.md, results_drafts.md). The
traces are benchmarks/results/traces_policy_<pair>[_more].json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import RESULTS
from benchmarks.prompts import PROMPT_SETS, kind_of, prompt_texts
from foundation.sequence import TokenSequence
from model_runtime.fingerprint import ANY_VOCABULARY
from model_runtime.width_padding import WidthPlan
from speculative.drafter_base import Drafter, DraftSession, Proposal
from speculative.policy import AdaptiveK, FixedK
from speculative.prompt_lookup import LookupThenModelDrafter, NgramDrafter
from speculative.sampling import SamplingParams
from speculative.speculation_loop import Features, speculation_rounds
from speculative.types import NextTokenKind, Verdict, VerifyResult

MAX_K = 8
FIXED_KS = (1, 2, 3, 4, 5, 6, 8)
MAX_NEW_TOKENS = 64
MS = 1_000_000


@dataclass(frozen=True)
class Costs:
    """Virtual costs in ms: a target pass over 1..len(target_ms) new tokens as timed (wider:
    on from the last at the timed widths' mean slope), a draft token, a round trip."""

    target_ms: tuple[float, ...]
    draft_ms: float
    round_trip_ms: float
    pad: bool = True  # the worker runs each width at its cheapest (width_padding.WidthPlan)

    @property
    def plan(self) -> WidthPlan:
        return WidthPlan.from_costs(dict(enumerate(self.target_ms, start=1)))

    def pass_ns(self, width: int) -> float:
        run = self.plan.width(width) if self.pad else width
        last = len(self.target_ms)
        if run <= last:
            return self.target_ms[run - 1] * MS
        slope = max(0.0, (self.target_ms[-1] - self.target_ms[0]) / (last - 1))
        return (self.target_ms[-1] + (run - last) * slope) * MS


# Calibrated pass costs of each target (ms, widths 1-12, 64 cached tokens, 2 threads;
# results/archive/results_width_padding.md), the int8 0.5B draft's token (results_drafts.md
# there), loopback R.
COSTS = {
    "smollm2": Costs(
        (40, 45, 37, 36, 38, 38, 42, 42, 44, 46, 50, 48), draft_ms=0.0, round_trip_ms=2.0
    ),
    "qwen": Costs(
        (237, 287, 203, 203, 189, 181, 228, 230, 231, 260, 272, 292),
        draft_ms=39.0,
        round_trip_ms=3.0,
    ),
}
DRAFTERS = {"smollm2": ("ngram",), "qwen": ("model", "ngram+model")}


def traces_path(pair: str, prompt_set: str = "") -> Path:
    return RESULTS / f"traces_policy_{pair}{'_' + prompt_set if prompt_set else ''}.json"


def load_traces(pair: str, prompt_set: str = "") -> dict:
    """The recorded traces of a prompt set; "all": the suite's (named kind/0) and "more"'s."""
    if prompt_set == "all":
        return {f"{name}/0": trace for name, trace in load_traces(pair).items()} | load_traces(
            pair, "more"
        )
    return json.loads(traces_path(pair, prompt_set).read_text())["traces"]


# --- virtual time ---------------------------------------------------------------------------


class Clock:
    def __init__(self, jitter: float, seed: int):
        self.now_ns, self.jitter, self.random = 0, jitter, random.Random(seed)

    def spend(self, ns: float) -> int:
        """Advances by ns, jittered; returns what it spent."""
        spent = int(ns * math.exp(self.random.gauss(0.0, self.jitter))) if self.jitter else int(ns)
        self.now_ns += spent
        return spent


@contextlib.contextmanager
def virtual_time(clock: Clock):
    """time.perf_counter_ns reads the clock (the loop times everything with it)."""
    real = time.perf_counter_ns
    time.perf_counter_ns = lambda: clock.now_ns
    try:
        yield
    finally:
        time.perf_counter_ns = real


class ReplayTarget:
    """The loop's Verifier over a recorded greedy path: `reference` is prompt + path."""

    overlaps = False
    runs_lookup = True

    def __init__(self, reference: list[int], stop_ids: set[int], clock: Clock, costs: Costs):
        self.reference, self.stop_ids, self.clock, self.costs = reference, stop_ids, clock, costs
        self._sent: list[tuple[int, list[int]]] = []

    def send(
        self, base_len, draft_token_ids, draft_probs, expected_last_token_id=None, parents=None
    ) -> None:
        assert parents is None, "the replay verifies chains"
        self._sent.append((base_len, list(draft_token_ids)))

    def receive(self) -> VerifyResult:
        base_len, proposed = self._sent.pop(0)
        self.clock.spend(self.costs.round_trip_ms * MS)
        return self._pass(base_len, proposed)

    def verdict_came(self) -> bool:
        return False

    def abandon_last(self) -> None:
        raise AssertionError("nothing is drafted ahead in the replay")

    def decode(self, base_len, max_tokens, until=None, lookup=None):
        self.clock.spend(self.costs.round_trip_ms * MS)
        length, left = base_len, max_tokens
        # as TargetSession.decode_steps
        room = max(lookup.room, max_tokens) if lookup is not None else max_tokens
        while left > 0:
            proposal = lookup.proposal(self.reference[:length], room) if lookup is not None else []
            result = self._pass(length, proposal)
            yield result
            if result.stopped or (
                until is not None and until.matches(self.reference[: result.committed_len])
            ):
                return
            length, left, room = (
                result.committed_len,
                left - len(result.token_ids),
                room - len(result.token_ids),
            )

    def _pass(self, base_len: int, proposed: list[int]) -> VerifyResult:
        truth = self.reference[base_len:]
        accepted = 0
        while (
            accepted < min(len(proposed), len(truth) - 1) and proposed[accepted] == truth[accepted]
        ):
            accepted += 1
        committed = truth[: accepted + 1]
        stop = next((i for i, token in enumerate(committed) if token in self.stop_ids), None)
        if stop is not None:
            committed = committed[: stop + 1]
        compute = self.clock.spend(self.costs.pass_ns(len(proposed) + 1))
        kind = NextTokenKind.BONUS if accepted == len(proposed) else NextTokenKind.RECOVERED
        return VerifyResult(
            Verdict(accepted, truth[accepted], kind),
            committed,
            base_len + len(committed),
            stopped=stop is not None,
            target_compute_ns=compute,
            received_ns=self.clock.now_ns,
            num_drafted=len(proposed),
        )


class RecordedDrafter(Drafter):
    """The draft model's recorded continuations: at prefix length p, drafts[p - prompt length]."""

    name, fingerprint = "replay", ANY_VOCABULARY

    def __init__(self, drafts: list[list[int]], clock: Clock, costs: Costs):
        self.drafts, self.clock, self.costs = drafts, clock, costs

    def open(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> DraftSession:
        return RecordedDraftSession(self, list(prompt_token_ids))


class RecordedDraftSession(DraftSession):
    def __init__(self, drafter: RecordedDrafter, token_ids: list[int]):
        self.drafter = drafter
        self.tokens = TokenSequence(token_ids)
        self.prompt_len = len(token_ids)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def propose(self, k: int, min_reach: float = 0.0) -> Proposal:
        position = self.length - self.prompt_len
        proposal = self.drafter.drafts[position][:k] if position < len(self.drafter.drafts) else []
        self.drafter.clock.spend(len(proposal) * self.drafter.costs.draft_ms * MS)
        self.tokens.append(proposal)
        return Proposal(proposal)

    def append(self, token_ids: Sequence[int]) -> None:
        self.tokens.append(token_ids)

    def truncate_to(self, length: int) -> None:
        self.tokens.truncate_to(length)


# --- the replay -------------------------------------------------------------------------------


def replay_call(
    trace: dict,
    drafter_name: str,
    k: int | None,
    costs: Costs,
    clock: Clock,
    seed_from: AdaptiveK | None = None,
    widths_known: bool = True,
    features: Features = Features(),
) -> tuple[float, AdaptiveK | None]:
    """One call (k None: adaptive); its tokens per virtual second. Checks the output."""
    prompt, path = trace["prompt"], trace["path"]
    drafter = {
        "ngram": lambda: NgramDrafter(),
        "model": lambda: RecordedDrafter(trace["drafts"], clock, costs),
        "ngram+model": lambda: LookupThenModelDrafter(
            RecordedDrafter(trace["drafts"], clock, costs), NgramDrafter()
        ),
    }[drafter_name]()
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=tuple(trace["stop_ids"]))
    policy = FixedK(k) if k is not None else AdaptiveK(MAX_K)
    policy.start_call(
        costs.plan.costs_ms if widths_known and costs.pad else (),
        seed_from.end_call() if seed_from is not None else None,
    )
    target = ReplayTarget(prompt + path, set(trace["stop_ids"]), clock, costs)
    start, out = clock.now_ns, []
    with virtual_time(clock):
        for result in speculation_rounds(
            target, drafter.open(prompt, params), len(prompt), params, policy, 1 << 20, features
        ):
            out += result.token_ids
    assert out == path[: len(out)], "the replay diverged from the target's path"
    return len(out) / ((clock.now_ns - start) / 1e9), (policy if k is None else None)


def target_only_rate(trace: dict, costs: Costs) -> float:
    """Tokens per second decoding alone (a Decode stream: a pass a token, R once)."""
    tokens = min(MAX_NEW_TOKENS, len(trace["path"]))
    return tokens / ((tokens * costs.pass_ns(1) + costs.round_trip_ms * MS) / 1e9)


def seeded_adaptive(
    traces: dict, drafter_name: str, costs: Costs, clock: Clock, widths_known: bool = True
) -> dict[str, float]:
    """Each trace's adaptive tokens/s, every call seeded by the one before it: the traces
    run twice in their order and the second pass is reported."""
    rates, seeded = {}, None
    for reported in (False, True):
        for name, trace in traces.items():
            rate, seeded = replay_call(
                trace, drafter_name, None, costs, clock, seeded, widths_known
            )
            if reported:
                rates[name] = rate
    return rates


def interleaved(traces: dict) -> dict:
    """The traces with kinds interleaved (kind/0 of each, then kind/1, ...), as the suite
    runs them: each adaptive call is seeded by one of another kind."""
    return {name: traces[name] for name in sorted(traces, key=lambda n: int(n.split("/")[1]))}


def replay(
    traces: dict,
    drafter_name: str,
    costs: Costs,
    jitter: float,
    repeats: int,
    widths_known: bool = True,
) -> dict[str, dict[str, float]]:
    """{prompt: {method: median tokens/s over the repeats}}; methods k=1.. and adaptive."""
    rates: dict[str, dict[str, list[float]]] = {name: {} for name in traces}
    for repeat in range(repeats):
        clock = Clock(jitter, seed=repeat)
        for name, rate in seeded_adaptive(traces, drafter_name, costs, clock, widths_known).items():
            rates[name].setdefault("adaptive", []).append(rate)
        for name, trace in traces.items():
            for k in FIXED_KS:
                rates[name].setdefault(f"k={k}", []).append(
                    replay_call(trace, drafter_name, k, costs, clock)[0]
                )
    return {
        name: {method: statistics.median(values) for method, values in by_method.items()}
        for name, by_method in rates.items()
    }


def policy_report(pair: str, traces: dict, costs: Costs, jitter: float, repeats: int) -> str:
    lines = [
        f"Costs (ms): target pass by width {list(costs.target_ms)}, run as {list(costs.plan.run_as)}"
        f"{'' if costs.pad else ' (padding off)'}; draft token {costs.draft_ms}; round trip {costs.round_trip_ms}. "
        f"Jitter {jitter:g} (log-normal sigma), median of {repeats} seeded repeats.",
        "",
    ]
    for drafter_name in DRAFTERS[pair]:
        for widths_known in (True, False) if costs.pad else (True,):
            table = replay(traces, drafter_name, costs, jitter, repeats, widths_known)
            title = f"### {drafter_name}" + (
                ""
                if not costs.pad
                else ", step costs told"
                if widths_known
                else ", step costs not told"
            )
            methods = [f"k={k}" for k in FIXED_KS] + ["adaptive"]
            lines += [
                title,
                "",
                "| prompt | " + " | ".join(methods) + " | best fixed k | adaptive / best |",
                "|---" * (len(methods) + 3) + "|",
            ]
            ratios = []
            for name, rates in table.items():
                base = target_only_rate(traces[name], costs)
                best = max((m for m in methods if m != "adaptive"), key=rates.get)
                ratios.append(rates["adaptive"] / rates[best])
                cells = " | ".join(f"{rates[m] / base:.2f}x" for m in methods)
                lines.append(f"| {name} | {cells} | {best} | {ratios[-1]:.3f} |")
            geo = statistics.geometric_mean(ratios)
            lines += [
                "",
                f"Adaptive over the best fixed k: geometric mean {geo:.3f}, lowest {min(ratios):.3f}.",
                "",
            ]
    return "\n".join(lines)


def shifted(trace: dict, offset: int) -> dict:
    """The same call started `offset` tokens later (those tokens joined to the prompt): where rounds fall moves."""
    return {
        **trace,
        "prompt": trace["prompt"] + trace["path"][:offset],
        "path": trace["path"][offset:],
        **({"drafts": trace["drafts"][offset:]} if "drafts" in trace else {}),
    }


def against_fixed(calls: list[dict[str, float]]) -> tuple[str, list[float], float, float]:
    """Over a group of calls ({method: tokens/s}): the fixed k fastest over all of them (geometric mean),
    adaptive over it in each call, adaptive over each call's own fastest fixed k, and what that hindsight
    pick gains over the group's k (geometric means over the calls)."""
    fixed = [method for method in calls[0] if method != "adaptive"]
    best = max(
        fixed, key=lambda method: statistics.geometric_mean([call[method] for call in calls])
    )
    tops = [max(call[method] for method in fixed) for call in calls]
    return (
        best,
        [call["adaptive"] / call[best] for call in calls],
        statistics.geometric_mean([call["adaptive"] / top for call, top in zip(calls, tops)]),
        statistics.geometric_mean([top / call[best] for call, top in zip(calls, tops)]),
    )


def shifts_report(
    pair: str, traces: dict, costs: Costs, jitter: float, repeats: int, shifts: int
) -> str:
    """Per prompt, `shifts` calls each started a token later: the fixed k fastest over all of them, adaptive
    against it and against each call's own fastest fixed k, and what that hindsight pick gains over it."""
    lines = [
        f"Each trace started 0-{shifts - 1} tokens later ({shifts} calls a prompt), median of {repeats} "
        f"seeded repeats each; geometric means over the calls.",
        "",
    ]
    for drafter_name in DRAFTERS[pair]:
        lines += [
            f"### {drafter_name}",
            "",
            "| prompt | fixed k best over the calls | adaptive / it | "
            "adaptive / each call's best fixed k | each call's best / the calls' best |",
            "|---|---|---|---|---|",
        ]
        for name, trace in traces.items():
            calls = [
                replay({name: shifted(trace, offset)}, drafter_name, costs, jitter, repeats)[name]
                for offset in range(shifts)
            ]
            best, ratios, own, gain = against_fixed(calls)
            lines.append(
                f"| {name} | {best} | {statistics.geometric_mean(ratios):.3f} | {own:.3f} | {gain:.3f} |"
            )
        lines.append("")
    return "\n".join(lines)


def kinds_report(pair: str, traces: dict, costs: Costs, jitter: float, repeats: int) -> str:
    """Several prompts a kind (named kind/i): adaptive against the fixed k best for the kind (over its prompts)
    and against each prompt's own best fixed k, and what that hindsight pick gains over the kind's k."""
    order = interleaved(traces)
    lines = [
        f"{len(traces)} prompts, median of {repeats} seeded repeats each; geometric means over a kind's prompts.",
        "",
    ]
    for drafter_name in DRAFTERS[pair]:
        table = replay(order, drafter_name, costs, jitter, repeats)
        lines += [
            f"### {drafter_name}",
            "",
            "| kind | fixed k best for the kind | adaptive / it | lowest prompt | "
            "adaptive / each prompt's best fixed k | each prompt's best / the kind's |",
            "|---" * 6 + "|",
        ]
        for kind in dict.fromkeys(kind_of(name) for name in order):
            best, ratios, own, gain = against_fixed(
                [rates for name, rates in table.items() if kind_of(name) == kind]
            )
            lines.append(
                f"| {kind} | {best} | {statistics.geometric_mean(ratios):.3f} | {min(ratios):.3f} | "
                f"{own:.3f} | {gain:.3f} |"
            )
        lines.append("")
    return "\n".join(lines)


def cascade_report(traces: dict, costs: Costs, jitter: float, repeats: int) -> str:
    """The cascade (ngram+model) against the better of its parts alone, adaptive, by kind:
    in virtual time. Each call seeded by the one before it."""
    ordered = interleaved(traces)
    rates: dict[tuple[str, str], list[float]] = {}
    for drafter_name in ("ngram", "model", "ngram+model"):
        for repeat in range(repeats):
            clock = Clock(jitter, seed=repeat)
            for name, rate in seeded_adaptive(ordered, drafter_name, costs, clock).items():
                rates.setdefault((name, drafter_name), []).append(rate)
    rate = {key: statistics.median(values) for key, values in rates.items()}
    lines = [
        f"{len(traces)} prompts, median of {repeats} seeded repeats each; tok/s in virtual "
        "time, geometric means over a kind's prompts.",
        "",
        "| kind | lookup | model | cascade | cascade / better part | lowest prompt |",
        "|---" * 6 + "|",
    ]
    for kind in dict.fromkeys(kind_of(name) for name in ordered):
        names = [name for name in ordered if kind_of(name) == kind]
        means = {
            d: statistics.geometric_mean([rate[(n, d)] for n in names])
            for d in ("ngram", "model", "ngram+model")
        }
        lowest = min(
            rate[(n, "ngram+model")] / max(rate[(n, "ngram")], rate[(n, "model")]) for n in names
        )
        lines.append(
            f"| {kind} | {means['ngram']:.2f} | {means['model']:.2f} | {means['ngram+model']:.2f} "
            f"| {means['ngram+model'] / max(means['ngram'], means['model']):.3f} | {lowest:.3f} |"
        )
    return "\n".join(lines)


# --- recording --------------------------------------------------------------------------------


def record(pair_name: str, tokens: int, prompt_set: str = "") -> None:
    from benchmarks.common import PAIRS, chat_ids
    from benchmarks.prompts import PROMPTS
    from model_runtime.loading import load_model
    from speculative.drafters import ModelDrafter
    from speculative.generator import SpeculativeGenerator

    pair = PAIRS[pair_name]
    target = load_model(pair.target)
    draft = load_model(pair.draft, quantize=pair.quantization) if pair.draft else None
    stop_ids = [target.tokenizer.eos_token_id] if target.tokenizer.eos_token_id is not None else []
    traces = {}
    for name, text in prompt_texts(tuple(PROMPTS), prompt_set).items():
        prompt = list(chat_ids(target.tokenizer, text))
        # MAX_K + 1 past the replayed tokens: every proposal's verdict is known
        params = SamplingParams(max_new_tokens=tokens + MAX_K + 1, stop_token_ids=tuple(stop_ids))
        path = SpeculativeGenerator(target).generate(prompt, params, k=0).token_ids
        trace = {"prompt": prompt, "path": path, "stop_ids": stop_ids}
        if draft is not None:
            session = ModelDrafter(draft).open(prompt, SamplingParams())
            trace["drafts"] = []
            for token in path:
                length = session.length
                trace["drafts"].append(session.propose(MAX_K).token_ids)
                session.truncate_to(length)
                session.append([token])
        traces[name] = trace
        print(
            f"{name}: {len(prompt)} prompt tokens, {len(path)} decoded", file=sys.stderr, flush=True
        )
    traces_path(pair_name, prompt_set).write_text(
        json.dumps({"pair": [pair.target, pair.draft, pair.quantization], "traces": traces})
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks replay", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("command", nargs="?", choices=["record", "replay"], default="replay")
    parser.add_argument("--pair", choices=sorted(COSTS), default="smollm2")
    parser.add_argument(
        "--tokens", type=int, default=MAX_NEW_TOKENS, help="record: tokens to decode"
    )
    parser.add_argument("--jitter", type=float, default=0.05, help="log-normal sigma of every cost")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--no-padding", action="store_true", help="the target runs each width as it is"
    )
    parser.add_argument(
        "--target-ms",
        default="",
        help="another machine's target pass by width 1, 2, ... "
        "(comma-separated ms; default: the pair's calibration)",
    )
    parser.add_argument(
        "--draft-ms", type=float, default=None, help="another machine's draft token, ms"
    )
    parser.add_argument(
        "--shifts",
        type=int,
        default=0,
        help="instead: each trace started 0..N-1 tokens later, "
        "adaptive against the fixed k best over those calls and against each call's own best",
    )
    parser.add_argument(
        "--cascade",
        action="store_true",
        help="instead: the cascade against the better of its parts, by kind (qwen)",
    )
    parser.add_argument(
        "--prompt-set",
        choices=PROMPT_SETS,
        default="",
        help="more: six other prompts of each kind (record them first); all: those and the "
        "suite's; reported by kind",
    )
    args = parser.parse_args(argv)
    if args.cascade and "ngram+model" not in DRAFTERS[args.pair]:
        parser.error(f"--cascade needs a pair with a draft model; {args.pair} has none")
    if args.command == "record" and args.prompt_set == "all":
        parser.error("record the sets one at a time ('' and more)")
    if args.command == "record":
        record(args.pair, args.tokens, args.prompt_set)
        return 0
    costs = dataclasses.replace(COSTS[args.pair], pad=not args.no_padding)
    if args.target_ms:
        costs = dataclasses.replace(
            costs, target_ms=tuple(float(ms) for ms in args.target_ms.split(","))
        )
    if args.draft_ms is not None:
        costs = dataclasses.replace(costs, draft_ms=args.draft_ms)
    traces = load_traces(args.pair, args.prompt_set)
    if args.cascade:
        print(cascade_report(traces, costs, args.jitter, args.repeats))
    elif args.prompt_set:
        print(kinds_report(args.pair, traces, costs, args.jitter, args.repeats))
    elif args.shifts:
        print(shifts_report(args.pair, traces, costs, args.jitter, args.repeats, args.shifts))
    else:
        print(policy_report(args.pair, traces, costs, args.jitter, args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
