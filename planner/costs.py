"""The fleet model's inputs: what a measurement writes and the planner reads (a JSON file).

Every time is in milliseconds, every rate per second; each group names its `source`
(the run, trace or datasheet it came from, or "assumed"). The groups:

- `target`: a batched pass over R sessions (rows) and T tokens with logits (draft
  tokens to verify, decode tokens) plus P prompt tokens costs
  base + per_token T + per_row R + prefill_token P, and never less than the compute
  floor compute_per_token (T + P): the step cost the target worker already fits
  (`foundation.load.StepLoad`: base + T per_token), with the rows' KV reads apart.
- `draft`: a draft step (one token for every session drafting at once) by batch size.
- `workloads`: acceptance by position, a_i = P(draft token i accepted | tokens 1..i-1
  were), i = 1..k_max, per workload, from traces (`acceptance_from_rounds`).
- `link`: the one-way delay between a draft worker and a target worker: one value
  (constant) or samples drawn uniformly.
- `arrivals`: Poisson arrivals over the whole fleet; `request`: a request's shape.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from foundation.pass_cost import PassCost
from speculative.estimator import depth_expected_tokens, depth_reach

SCHEMA = 1  # the file's version: a measurement and the planner must agree on it
NS_PER_MS = 1_000_000


@dataclass(frozen=True)
class TargetPass:
    """What the target worker's batched pass costs, in ms."""

    base_ms: float  # a pass of no tokens: the weights read once (memory-bound)
    per_token_ms: float  # each token with logits in the pass (any session's)
    per_row_ms: float = 0.0  # each session (row) in the pass: its KV cache read
    # A prompt token (prefill, no logits); None: as a token with logits.
    prefill_token_ms: float | None = None
    # The compute-bound floor: a token's FLOPs over the peak (0: none).
    compute_per_token_ms: float = 0.0
    max_sessions: int = 64  # sessions a worker holds at once (KV memory); more wait
    max_batch_tokens: int = 0  # tokens a pass takes at most (0: no limit)
    # While sessions decode, a pass's prompt chunks cost at most this share of the rest
    # (the worker's stall-free batching, model_runtime/step_scheduler.PREFILL_SHARE).
    prefill_share: float = 0.5
    source: str = ""

    @classmethod
    def from_step_cost(cls, cost: PassCost, **fields) -> TargetPass:
        """From the step cost a target worker fits (`StepLoad.cost`, in ns), the other
        fields as given."""
        return cls(
            base_ms=cost.base_ns / NS_PER_MS,
            per_token_ms=cost.per_token_ns / NS_PER_MS,
            prefill_token_ms=(cost.per_prefill_token_ns / NS_PER_MS) or None,
            **fields,
        )

    def step_cost(self, rows: int) -> PassCost:
        """The line of a pass over `rows` sessions, in ns, as a target worker fits and
        reports it (foundation/pass_cost.py): its base holds the rows' KV reads."""
        prefill_ms = self.per_token_ms if self.prefill_token_ms is None else self.prefill_token_ms
        return PassCost(
            (self.base_ms + self.per_row_ms * rows) * NS_PER_MS,
            self.per_token_ms * NS_PER_MS,
            prefill_ms * NS_PER_MS,
        )

    @property
    def prefill_ms_a_token(self) -> float:
        return self.per_token_ms if self.prefill_token_ms is None else self.prefill_token_ms

    def pass_ms(self, rows: int, tokens: int, prefill_tokens: int = 0) -> float:
        """A pass over `rows` sessions, `tokens` tokens with logits and `prefill_tokens`."""
        memory = self.step_cost(rows).ns(tokens, prefill_tokens) / NS_PER_MS
        return max(memory, self.compute_per_token_ms * (tokens + prefill_tokens))


@dataclass(frozen=True)
class DraftStep:
    """What a draft worker's step costs, in ms: one draft token for each of `batch`
    sessions, linear between the measured batch sizes and on at the last slope past them."""

    ms_by_batch: tuple[tuple[int, float], ...]  # [(sessions drafting at once, ms a step)]
    prefill_token_ms: float = 0.0  # a prompt token the draft reads (its prefill, catch-up)
    # The same step run on the target's device (co-located); empty: as ms_by_batch.
    colocated_ms_by_batch: tuple[tuple[int, float], ...] = ()
    source: str = ""

    def step_ms(self, batch: int, colocated: bool = False) -> float:
        table = self.colocated_ms_by_batch if colocated and self.colocated_ms_by_batch else None
        return _interpolate(table or self.ms_by_batch, batch)


@dataclass(frozen=True)
class Acceptance:
    """A workload's acceptance by position (from traces)."""

    by_position: tuple[float, ...]  # [k_max] a_i, for draft tokens i = 1..k_max
    source: str = ""

    @property
    def k_max(self) -> int:
        return len(self.by_position)

    def reach(self, depth: int) -> float:
        """The chance that the first `depth` draft tokens are all accepted (the policy's
        own arithmetic: speculative/estimator.py)."""
        return depth_reach(self.by_position, 1.0, depth)

    def expected_tokens(self, k: int) -> float:
        """E[tokens] of a round of k draft tokens, the target's own included: 1 + reach(1)
        + ... + reach(k) (Leviathan's (1 - a^(k+1)) / (1 - a) where every a_i is a)."""
        return depth_expected_tokens(self.by_position, 1.0, k)


@dataclass(frozen=True)
class Link:
    """Between a draft worker and a target worker, in ms."""

    one_way_ms: tuple[float, ...]  # one value: constant; several: samples drawn uniformly
    local_one_way_ms: float = 0.0  # draft and target on one host (loopback)
    round_overhead_ms: float = 0.0  # host work a round adds on the draft side (bookkeeping)
    source: str = ""

    @property
    def median_ms(self) -> float:
        ordered = sorted(self.one_way_ms)
        return ordered[len(ordered) // 2]


@dataclass(frozen=True)
class Arrivals:
    rate_per_s: float  # requests a second over the whole fleet (Poisson)
    source: str = ""


@dataclass(frozen=True)
class Request:
    prompt_tokens: int
    new_tokens: int  # every request generates this many (no early stop)
    source: str = ""


@dataclass(frozen=True)
class Costs:
    """The whole file."""

    target: TargetPass
    draft: DraftStep
    workloads: dict[str, Acceptance]
    link: Link
    arrivals: Arrivals
    request: Request
    notes: str = ""
    schema: int = field(default=SCHEMA)

    def __post_init__(self) -> None:
        check(self)

    def acceptance(self, workload: str | None = None) -> Acceptance:
        """The named workload's acceptance (None: the first)."""
        if workload is None:
            return next(iter(self.workloads.values()))
        if workload not in self.workloads:
            raise ValueError(f"no workload {workload!r}: the file has {sorted(self.workloads)}")
        return self.workloads[workload]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Costs:
        if data.get("schema", SCHEMA) != SCHEMA:
            raise ValueError(f"costs file schema {data.get('schema')}, the planner reads {SCHEMA}")
        draft = data["draft"]
        return cls(
            target=TargetPass(**data["target"]),
            draft=DraftStep(
                **{
                    **draft,
                    "ms_by_batch": _pairs(draft["ms_by_batch"]),
                    "colocated_ms_by_batch": _pairs(draft.get("colocated_ms_by_batch", ())),
                }
            ),
            workloads={
                name: Acceptance(tuple(w["by_position"]), w.get("source", ""))
                for name, w in data["workloads"].items()
            },
            link=Link(**{**data["link"], "one_way_ms": tuple(data["link"]["one_way_ms"])}),
            arrivals=Arrivals(**data["arrivals"]),
            request=Request(**data["request"]),
            notes=data.get("notes", ""),
        )

    @classmethod
    def load(cls, path: str | Path) -> Costs:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def check(costs: Costs) -> None:
    """ValueError naming the first input out of its range."""
    t, d = costs.target, costs.draft
    problems = [
        (min(t.base_ms, t.per_token_ms, t.per_row_ms, t.compute_per_token_ms) < 0, "target times"),
        (t.pass_ms(1, 1) <= 0, "target.pass_ms(1, 1) must be above 0"),
        (t.max_sessions < 1, "target.max_sessions"),
        (not d.ms_by_batch or min(ms for _, ms in d.ms_by_batch) < 0, "draft.ms_by_batch"),
        (min((b for b, _ in d.ms_by_batch), default=0) < 1, "draft batch sizes start at 1"),
        (not costs.workloads, "workloads: at least one"),
        (not costs.link.one_way_ms or min(costs.link.one_way_ms) < 0, "link.one_way_ms"),
        (costs.arrivals.rate_per_s < 0, "arrivals.rate_per_s"),
        (costs.request.new_tokens < 1 or costs.request.prompt_tokens < 0, "request shape"),
    ]
    problems += [
        (not a.by_position or not all(0.0 <= p <= 1.0 for p in a.by_position), f"workload {name}")
        for name, a in costs.workloads.items()
    ]
    bad = [what for failed, what in problems if failed]
    if bad:
        raise ValueError(f"costs out of range: {bad[0]}")


def acceptance_from_rounds(rounds: Iterable[tuple[int, int]], k_max: int) -> tuple[float, ...]:
    """a_i for i = 1..k_max from (k, accepted) of rounds (a trace's, any k): the rounds
    that accepted token i over those that drafted it and accepted every token before it.
    A position no round reached reads as the one before it (1.0 before the first)."""
    accepted, reached = [0] * k_max, [0] * k_max
    for k, num_accepted in rounds:
        for i in range(min(k, num_accepted + 1, k_max)):  # i: 0-based position
            reached[i] += 1
            accepted[i] += i < num_accepted
    rates, rate = [], 1.0
    for hits, trials in zip(accepted, reached):
        rate = hits / trials if trials else rate
        rates.append(rate)
    return tuple(rates)


def acceptance_from_spans(paths: Sequence[str | Path], k_max: int) -> tuple[float, ...]:
    """a_i from the draft workers' round spans (`python -m report`'s trace files)."""
    from report.traces import read_spans, rounds_of

    return acceptance_from_rounds(((r.k, r.accepted) for r in rounds_of(read_spans(paths))), k_max)


def acceptance_from_continuations(trace: dict, k_max: int) -> list[tuple[int, int]]:
    """(k, accepted) rounds of a recorded greedy trace with the draft's continuation at
    every position (benchmarks/replay_policy.py's `record` format: path, drafts): a round
    of k_max started at each position."""
    path, rounds = trace["path"], []
    for position, drafted in enumerate(trace["drafts"]):
        truth = path[position:]
        k = min(k_max, len(drafted), len(truth) - 1)
        accepted = next((i for i in range(k) if drafted[i] != truth[i]), k)
        if k > 0:
            rounds.append((k, accepted))
    return rounds


def _pairs(rows: Iterable[Sequence[float]]) -> tuple[tuple[int, float], ...]:
    return tuple(sorted((int(batch), float(ms)) for batch, ms in rows))


def _interpolate(table: Sequence[tuple[int, float]], x: int) -> float:
    """Linear between the table's points; flat before the first; past the last, on at the
    last segment's slope where it rises (flat where it falls, or the table has one point):
    a larger batch never costs less than the largest measured."""
    if x <= table[0][0] or len(table) == 1:
        return table[0][1]
    segments = list(zip(table, table[1:]))
    (x0, y0), (x1, y1) = next(((a, b) for a, b in segments if x <= b[0]), segments[-1])
    if x > x1:
        return y1 + max(0.0, y1 - y0) * (x - x1) / (x1 - x0)
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
