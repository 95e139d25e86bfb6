"""What pipelining can gain on a model pair: greedy traces replayed under the
synchronous and the pipelined schedule, with costs measured on one core per side.

    .venv/bin/python -m benchmarks.replay_pipeline record     # ~8 min: traces + costs
    .venv/bin/python -m benchmarks.replay_pipeline record-branches  # ~2 min: top-2 tokens, batch-2 cost
    .venv/bin/python -m benchmarks.replay_pipeline            # the replay, instant

`record` decodes each prompt greedily with the target (chat template), and at every
position the draft's greedy continuation of MAX_K tokens from the target's own prefix;
it times one draft pass and target passes of width 1..MAX_K + 1, one torch thread each
(run it under `taskset -c 1` on a quiet machine). Greedy acceptance is then exact
arithmetic: a proposal from position i is accepted up to its first token that differs
from the target's path.

The replay runs the speculation loop's two schedules in virtual time, R the round trip:
- synchronous: draft k tokens (k d), send, the target's pass c(k + 1), the verdict;
- pipelined, depth 1 (speculative.speculation_loop): after sending a proposal the draft
  drafts its guess of the target's next token, then up to k more while the verdict has
  not come, and sends them; the target verifies queued proposals back to back; one
  drafted ahead survives when all of its predecessor was accepted and the guess was
  right, else the draft starts afresh after the verdict.
It prints, per prompt and round trip, tokens/s of the best fixed k of each schedule
and their ratio: the bound a policy choosing k per prompt in hindsight would reach.
With `record-branches` data it also bounds schedules beyond one guess: drafting ahead
for the draft's two likeliest next tokens at once, and a target that decodes alone
while it would idle.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRACES = REPO / "benchmarks" / "traces_pipeline_qwen.json"
MAX_K = 8
PAIR = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")


def record(args) -> None:
    import torch
    from transformers import DynamicCache

    from model_runtime.loading import load_model

    torch.set_num_threads(1)
    loaded_target, loaded_draft = (load_model(name) for name in PAIR)
    target, draft, tokenizer = loaded_target.model, loaded_draft.model, loaded_target.tokenizer

    @torch.inference_mode()
    def greedy(ids, n):
        cache, x, out = DynamicCache(), torch.tensor([ids]), []
        for _ in range(n):
            out.append(int(target(x, past_key_values=cache, use_cache=True).logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
        return out

    @torch.inference_mode()
    def continuations(ids, path):
        cache = DynamicCache()
        logits = draft(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1]
        rows = []
        for token in path:
            length, row, step = cache.get_seq_length(), [], logits
            for _ in range(MAX_K):
                row.append(int(step.argmax()))
                step = draft(
                    torch.tensor([[row[-1]]]), past_key_values=cache, use_cache=True
                ).logits[0, -1]
            _crop(cache, length)
            rows.append(row)
            logits = draft(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[
                0, -1
            ]
        return rows

    traces = {}
    for name in args.prompts.split(","):
        ids = _chat_ids(tokenizer, name)
        path = greedy(ids, args.tokens)
        traces[name] = {"path": path, "drafts": continuations(ids, path)}
        print(f"{name}: {len(ids)} prompt tokens", file=sys.stderr, flush=True)
    ids = list(range(100, 160))
    costs = {
        "draft_ns": _pass_ns(draft, ids, 1),
        "target_ns": [_pass_ns(target, ids, width) for width in range(1, MAX_K + 2)],
    }
    TRACES.write_text(json.dumps({"pair": PAIR, "costs": costs, "traces": traces}))


def record_branches(args) -> None:
    """Adds to the traces what the branching schedules need: at each position the
    draft's two likeliest tokens (one teacher-forced pass over the target's path), and
    what a draft pass over a batch of two branches costs against one (timed, one
    torch thread, median of repeats)."""
    import torch

    from model_runtime.loading import load_model

    torch.set_num_threads(1)
    loaded = load_model(PAIR[1])
    draft, tokenizer = loaded.model, loaded.tokenizer
    data = json.loads(TRACES.read_text())
    for name, trace in data["traces"].items():
        ids = _chat_ids(tokenizer, name)
        with torch.inference_mode():
            logits = draft(torch.tensor([ids + trace["path"]])).logits[0, len(ids) - 1 : -1]
        trace["top"] = logits.topk(2).indices.tolist()
    ids = list(range(100, 400))
    ratios = sorted(
        _pass_ns(draft, ids, 1, batch=2, repeats=15) / _pass_ns(draft, ids, 1, repeats=15)
        for _ in range(5)
    )
    data["costs"]["draft_batch2_cost"] = ratios[len(ratios) // 2]
    TRACES.write_text(json.dumps(data))


def _chat_ids(tokenizer, name: str) -> list[int]:
    """The prompt's token ids, as a user message under the chat template."""
    from benchmarks.prompts import PROMPTS

    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[name]}], add_generation_prompt=True
    )
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def _crop(cache, length: int) -> None:
    if cache.get_seq_length() > length:
        cache.crop(length - cache.get_seq_length())


def _pass_ns(model, ids: list[int], width: int, batch: int = 1, repeats: int = 9) -> int:
    """A pass over `width` tokens after `ids` (cached), for `batch` sequences at once:
    the median of `repeats` timings, in nanoseconds."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache()
        model(torch.tensor([ids] * batch), past_key_values=cache, use_cache=True)
        length, times = cache.get_seq_length(), []
        for _ in range(repeats):
            start = time.perf_counter_ns()
            model(torch.tensor([[100] * width] * batch), past_key_values=cache, use_cache=True)
            times.append(time.perf_counter_ns() - start)
            _crop(cache, length)
    return sorted(times)[repeats // 2]


class Replay:
    """One prompt's trace under the costs, in virtual time (seconds). top: at each
    position, the draft's two likeliest tokens (for the two-guess schedule)."""

    def __init__(
        self,
        path: list[int],
        drafts: list[list[int]],
        draft_s: float,
        target_s: list[float],
        round_trip_s: float,
        top: list[list[int]] | None = None,
    ):
        self.path, self.drafts, self.top = path, drafts, top
        self.d, self.c, self.one_way = draft_s, target_s, round_trip_s / 2

    def accepted(self, base: int, k: int) -> int:
        proposal, n = self.drafts[base][:k], 0
        while n < k and base + n < len(self.path) and proposal[n] == self.path[base + n]:
            n += 1
        return n

    def synchronous(self, k: int, fill: bool = False) -> float:
        return self.run(k, ahead=False, fill=fill)

    def pipelined(
        self, k: int, guesses: int = 1, batch_cost: float = 1.0, fill: bool = False
    ) -> float:
        return self.run(k, ahead=True, guesses=guesses, batch_cost=batch_cost, fill=fill)

    def run(
        self, k: int, ahead: bool, guesses: int = 1, batch_cost: float = 1.0, fill: bool = False
    ) -> float:
        """Tokens/s of one schedule. ahead: depth-1 pipelining, drafting ahead for the
        draft's `guesses` likeliest next tokens at once, each pass costing batch_cost d
        (a batch of that many branches). fill: the target decodes alone whenever it
        would idle, in whole steps that end before the next proposal arrives (a bound:
        a real target cannot know when that is); a proposal that those tokens
        contradict is answered without a pass."""
        n = len(self.path)
        position, now, target_free, queued = 0, 0.0, 0.0, None
        while position < n:
            if queued is None:
                base, size = position, max(0, min(k, n - position - 1))
                now += size * self.d
                sent = now
            else:
                base, size, sent = queued
            arrival = sent + self.one_way
            solo = 0  # tokens the target decoded alone while it waited
            if fill and arrival > target_free:
                solo = min(int((arrival - target_free) / self.c[0]), n - position)
                target_free += solo * self.c[0]
            agreed = self.accepted(base, min(solo, size)) == min(solo, size)
            if solo and (not agreed or solo >= size):
                position, all_accepted, done = base + solo, agreed, target_free
            else:
                rest = size - solo
                done = target_free = max(target_free, arrival) + self.c[rest]
                accepted = self.accepted(base, size)
                position = min(n, base + accepted + 1)
                all_accepted = accepted == size
            verdict = done + self.one_way
            queued, drafted, next_base = None, 0, base + size + 1
            room = min(k, n - next_base - 1, MAX_K)
            if ahead and size and room >= 1 and size < MAX_K:
                now += self.d  # the guesses: one pass
                while drafted < room and now < verdict:
                    now += batch_cost * self.d
                    drafted += 1
                ahead_sent = now
            now = max(now, verdict)
            if (
                drafted
                and all_accepted
                and position == next_base
                and self._guessed(base, size, guesses)
            ):
                queued = (next_base, drafted, ahead_sent)
        return n / now

    def _guessed(self, base: int, size: int, guesses: int) -> bool:
        """Whether the target's token after a fully accepted proposal of `size` from
        `base` is among the draft's `guesses` likeliest there."""
        if guesses == 1:
            return self.drafts[base][size] == self.path[base + size]
        return self.path[base + size] in self.top[base + size][:guesses]


def _line(pass_s: list[float]) -> list[float]:
    """c(w) for w = 1.. as the least-squares line through the timed passes (one timed
    pass is noisy; the target's cost grows about linearly with width)."""
    widths = range(len(pass_s))
    mean_w, mean_c = sum(widths) / len(pass_s), sum(pass_s) / len(pass_s)
    slope = sum((w - mean_w) * (c - mean_c) for w, c in zip(widths, pass_s)) / sum(
        (w - mean_w) ** 2 for w in widths
    )
    return [mean_c + slope * (w - mean_w) for w in widths]


def replay(args) -> str:
    data = json.loads(TRACES.read_text())
    costs = data["costs"]
    draft_s, target_s = costs["draft_ns"] / 1e9, _line([t / 1e9 for t in costs["target_ns"]])
    batch2 = costs.get("draft_batch2_cost")
    lines = [
        f"# What depth-1 pipelining can gain: {data['pair'][1]} -> {data['pair'][0]}, replayed",
        "",
        f"Command: `python -m benchmarks.replay_pipeline` (traces: `{TRACES.relative_to(REPO)}`); one core "
        f"each: d = {draft_s * 1e3:.0f} ms a draft token, c(1) = {target_s[0] * 1e3:.0f} ms, "
        f"c({MAX_K + 1}) = {target_s[-1] * 1e3:.0f} ms (a line through the timed passes). "
        f"Best fixed k per prompt (1-{MAX_K - 1}), greedy, "
        f"{len(next(iter(data['traces'].values()))['path'])} tokens.",
        "",
        "| round trip | prompt | target-only tok/s | synchronous (k) | pipelined (k) | pipelined / synchronous |",
        "|---|---|---|---|---|---|",
    ]
    ratios: dict[str, list[list[float]]] = {}
    for round_trip_ms in args.round_trips:
        for name, trace in data["traces"].items():
            run = Replay(
                trace["path"],
                trace["drafts"],
                draft_s,
                target_s,
                round_trip_ms / 1e3,
                trace.get("top"),
            )
            sync = {k: run.synchronous(k) for k in range(1, MAX_K)}
            piped = {k: run.pipelined(k) for k in range(1, MAX_K)}
            best_sync, best_piped = max(sync, key=sync.get), max(piped, key=piped.get)
            alone = 1.0 / (target_s[0] + round_trip_ms / 1e3 / len(trace["path"]))
            lines.append(
                f"| {round_trip_ms:g} ms | {name} | {alone:.2f} | {sync[best_sync]:.2f} ({best_sync}) | "
                f"{piped[best_piped]:.2f} ({best_piped}) | {piped[best_piped] / sync[best_sync]:.2f}x |"
            )
            if batch2 is not None and "top" in trace:
                ratios.setdefault(f"{round_trip_ms:g} ms", []).append(
                    [
                        max(schedule(run, k) for k in range(1, MAX_K)) / sync[best_sync]
                        for schedule in _BRANCHING(batch2)
                    ]
                )
    if ratios:
        lines += _branching_table(ratios, batch2)
    return "\n".join(lines) + "\n"


def _BRANCHING(batch2: float):
    """The schedules beyond depth-1 pipelining, each a bound (see Replay.run)."""
    return (
        lambda run, k: run.pipelined(k),
        lambda run, k: run.pipelined(k, guesses=2, batch_cost=batch2),
        lambda run, k: run.pipelined(k, fill=True),
        lambda run, k: run.pipelined(k, guesses=2, batch_cost=batch2, fill=True),
        lambda run, k: run.pipelined(k, guesses=2, batch_cost=1.0),
    )


def _branching_table(ratios: dict[str, list[list[float]]], batch2: float) -> list[str]:
    """Geometric means over the prompts of each schedule's best k over the best
    synchronous k."""

    def geomean(values):
        return math.exp(sum(math.log(v) for v in values) / len(values))

    lines = [
        "",
        "Beyond one guess, each over the best synchronous k, geometric mean over the prompts (lowest "
        "prompt): drafting ahead for the draft's two likeliest next tokens as one batch (a pass over it "
        f"costs {batch2:.2f} of one, timed), and a target that decodes alone whenever it would idle, in "
        "steps that end before the next proposal arrives (it cannot know when: a bound).",
        "",
        "| round trip | pipelined | two guesses | target fills idle | both | two guesses, batch free |",
        "|---|---|---|---|---|---|",
    ]
    for round_trip, rows in ratios.items():
        cells = [f"{geomean(column):.2f}x ({min(column):.2f}x)" for column in zip(*rows)]
        lines.append(f"| {round_trip} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.replay_pipeline", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "command", nargs="?", choices=["record", "record-branches", "replay"], default="replay"
    )
    parser.add_argument("--prompts", default="chat,code_new,code_edit,summary,explain")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--round-trips", type=float, nargs="+", default=[4.0, 44.0], help="ms")
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args)
        return 0
    if args.command == "record-branches":
        record_branches(args)
        return 0
    text = replay(args)
    (REPO / "benchmarks" / "results_replay_qwen.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
