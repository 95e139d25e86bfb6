"""The planner: the fleet model (planner/fleet.py) run over layouts, speculation settings,
draft-to-target ratios and link delays, and what it picks for an objective.

Steps (`make_plan`):

1. target-only, and each setting co-located and remote (one draft worker a target, at
   the costs file's link): saturation, then the goodput at the objective;
2. the remote pool's ratio: the best remote setting at each ratio; the smallest ratio
   whose goodput is within `tolerance` of the best ratio's;
3. the pick: the layout with the highest goodput, where it beats the others by more
   than `tolerance` (a tie goes to the one with less hardware: target-only, then
   co-located);
4. the break-even delay: the one-way link delay past which the remote pool (its ratio
   and setting) no longer serves the best local layout's goodput within the objective.

Goodput: requests a second a target whose objective holds, the largest rate, below
saturation, at which the simulated p90 meets the bound (a bisection); for tokens-per-s,
the saturation rate itself.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from planner.costs import Costs
from planner.fleet import TARGET_ONLY, Cell, Layout, Result, Speculation, saturate, simulate

TOKENS = "tokens-per-s"
METRICS = {"tpot-p90-ms": "tpot_p90_ms", "ttft-p90-ms": "ttft_p90_ms", TOKENS: None}
LONGEST_DELAY_MS = 2000.0  # the break-even search stops here: paying up to it is "always"


@dataclass(frozen=True)
class Objective:
    metric: str  # a key of METRICS
    bound_ms: float | None = None  # the p90 bound (None for tokens-per-s)

    @classmethod
    def parse(cls, text: str) -> Objective:
        """`tpot-p90-ms=X`, `ttft-p90-ms=X` or `tokens-per-s`."""
        metric, _, bound = text.partition("=")
        if metric not in METRICS or (metric == TOKENS) != (bound == ""):
            raise ValueError(f"objective {text!r}: give tpot-p90-ms=X, ttft-p90-ms=X or {TOKENS}")
        return cls(metric, float(bound) if bound else None)

    def met(self, result: Result) -> bool:
        field = METRICS[self.metric]
        return field is None or getattr(result, field) <= self.bound_ms

    @property
    def label(self) -> str:
        return self.metric if self.bound_ms is None else f"{self.metric}={self.bound_ms:g}"


@dataclass(frozen=True)
class Search:
    """How hard the planner looks."""

    requests: int = 150  # requests a simulation (the first fifth warm up)
    seed: int = 0
    steps: int = 5  # bisection steps of a rate search
    delay_steps: int = 6  # bisection steps of the break-even delay search
    ks: tuple[int, ...] = (1, 2, 3, 4, 6)  # fixed k tried (those up to the acceptance's k_max)
    # (drafts, targets) cells of a remote pool: draft workers per target worker
    ratios: tuple[tuple[int, int], ...] = ((1, 4), (1, 2), (1, 1), (2, 1))
    # Goodputs this close are a tie (a seed moves a saturation by 2-3%): the smaller draft
    # pool, and the layout with less hardware, win a tie.
    tolerance: float = 0.03
    jobs: int = 1  # processes evaluating configurations at once


@dataclass(frozen=True)
class Evaluation:
    """One layout and setting: its saturation and its goodput at the objective."""

    cell: Cell
    speculation: Speculation
    saturation: Result
    goodput_per_s: float  # requests a second a target meeting the objective (0: none)
    at_goodput: Result | None  # the run at that rate (None: no rate met it)

    @property
    def label(self) -> str:
        cell = self.cell
        if cell.layout is Layout.REMOTE:
            return f"remote {cell.drafts}:{cell.targets}, {self.speculation.label}"
        return f"{cell.layout.value}, {self.speculation.label}"


@dataclass(frozen=True)
class Plan:
    objective: Objective
    workload: str
    evaluations: tuple[Evaluation, ...]  # every one tried, in order
    target_only: Evaluation
    colocated: Evaluation  # the best setting
    remote: Evaluation  # the best setting at the chosen ratio
    remote_by_ratio: tuple[Evaluation, ...]  # the best remote setting at each ratio
    local: Evaluation  # the pick without a draft pool: target-only or co-located
    chosen: Evaluation
    # One-way ms past which the remote pool stops paying: None, it never pays (even at 0);
    # inf, it pays up to LONGEST_DELAY_MS.
    break_even_delay_ms: float | None


@dataclass(frozen=True)
class _Task:
    costs: Costs
    cell: Cell
    speculation: Speculation
    objective: Objective
    search: Search
    workload: str | None


def evaluate(task: _Task) -> Evaluation:
    """Saturation, then the goodput: the highest rate below it that meets the objective."""
    costs, cell, spec, objective, search = (
        task.costs,
        task.cell,
        task.speculation,
        task.objective,
        task.search,
    )
    saturation = saturate(costs, cell, spec, workload=task.workload, seed=search.seed)
    if objective.metric == TOKENS:
        return Evaluation(cell, spec, saturation, saturation.rate_per_s, saturation)

    def run(rate: float) -> Result:
        return simulate(
            costs,
            cell,
            spec,
            rate,
            workload=task.workload,
            requests=search.requests,
            seed=search.seed,
        )

    rate, result = _highest(
        run, objective.met, 0.95 * saturation.rate_per_s, search.steps, floor=1 / 32
    )
    return Evaluation(cell, spec, saturation, rate, result)


def _highest(
    run: Callable[[float], Result],
    holds: Callable[[Result], bool],
    top: float,
    steps: int,
    floor: float,
) -> tuple[float, Result | None]:
    """The highest x in (floor x top, top] where holds(run(x)) (a bisection that takes it
    to be monotone); (0, None) where it fails at the floor too."""
    result = run(top)
    if holds(result):
        return top, result
    low, high = floor * top, top
    low_result = run(low)
    if not holds(low_result):
        return 0.0, None
    for _ in range(steps):
        middle = (low + high) / 2
        result = run(middle)
        if holds(result):
            low, low_result = middle, result
        else:
            high = middle
    return low, low_result


def make_plan(
    costs: Costs, objective: Objective, search: Search = Search(), workload: str | None = None
) -> Plan:
    acceptance = costs.acceptance(workload)
    name = workload or next(iter(costs.workloads))
    settings = [Speculation(k) for k in search.ks if k <= acceptance.k_max]
    settings.append(Speculation(None, acceptance.k_max))

    def tasks(cells_and_settings: Iterable[tuple[Cell, Speculation]]) -> list[_Task]:
        return [_Task(costs, c, s, objective, search, workload) for c, s in cells_and_settings]

    # 1. Target-only; each setting co-located and remote, one draft worker a target.
    one_to_one = Cell(Layout.REMOTE, targets=1, drafts=1)
    first = _evaluate_all(
        tasks(
            [(Cell(Layout.TARGET_ONLY), TARGET_ONLY)]
            + [(Cell(Layout.COLOCATED), s) for s in settings]
            + [(one_to_one, s) for s in settings]
        ),
        search.jobs,
    )
    target_only = first[0]
    colocated = _best(first[1 : 1 + len(settings)])
    best_remote = _best(first[1 + len(settings) :])
    # 2. The remote pool's ratio, at the best remote setting.
    others = [(d, t) for d, t in search.ratios if (d, t) != (1, 1)]
    by_ratio = _evaluate_all(
        tasks(
            (Cell(Layout.REMOTE, targets=t, drafts=d), best_remote.speculation) for d, t in others
        ),
        search.jobs,
    )
    by_ratio = sorted([*by_ratio, best_remote], key=lambda e: e.cell.ratio)
    top = max(e.goodput_per_s for e in by_ratio)
    remote = next(e for e in by_ratio if e.goodput_per_s >= (1 - search.tolerance) * top)
    # 3. The pick: less hardware on a tie.
    local = colocated if _beats(colocated, target_only, search) else target_only
    chosen = remote if _beats(remote, local, search) else local
    # 4. Where the remote pool stops paying.
    delay = break_even_delay(costs, remote, local.goodput_per_s, objective, search, workload)
    return Plan(
        objective,
        name,
        tuple([*first, *[e for e in by_ratio if e is not best_remote]]),
        target_only,
        colocated,
        remote,
        tuple(by_ratio),
        local,
        chosen,
        delay,
    )


def break_even_delay(
    costs: Costs,
    remote: Evaluation,
    rival_per_s: float,
    objective: Objective,
    search: Search,
    workload: str | None = None,
) -> float | None:
    """The one-way delay (ms) past which `remote` no longer serves rival_per_s requests a
    second a target within the objective (a rival with no goodput: a twentieth of the
    remote's saturation, i.e. at all). None: not even at 0; inf: still at LONGEST_DELAY_MS."""
    rate = rival_per_s if rival_per_s > 0 else remote.saturation.rate_per_s / 20

    def pays(delay_ms: float) -> bool:
        """As the goodput search decides: below 0.95 of saturation, the objective met."""
        cell = dataclasses.replace(remote.cell, one_way_ms=(delay_ms,))
        sat = saturate(
            costs,
            cell,
            remote.speculation,
            workload=workload,
            seed=search.seed,
            near=remote.saturation.rate_per_s,
        )
        if objective.metric == TOKENS:
            return sat.rate_per_s > rate
        if rate > 0.95 * sat.rate_per_s:
            return False
        result = simulate(
            costs,
            cell,
            remote.speculation,
            rate,
            workload=workload,
            requests=search.requests,
            seed=search.seed,
        )
        return objective.met(result)

    if not pays(0.0):
        return None
    low, high = 0.0, max(1.0, 4 * costs.link.median_ms)
    while pays(high):
        if high >= LONGEST_DELAY_MS:
            return math.inf
        low, high = high, min(4 * high, LONGEST_DELAY_MS)
    for _ in range(search.delay_steps):
        middle = (low + high) / 2
        low, high = (middle, high) if pays(middle) else (low, middle)
    return low


def _beats(this: Evaluation, that: Evaluation, search: Search) -> bool:
    """Goodput above that's by more than the tolerance (a tie is no win)."""
    return this.goodput_per_s > (1 + search.tolerance) * that.goodput_per_s


def _best(evaluations: list[Evaluation]) -> Evaluation:
    """The highest goodput; on a tie, the higher saturation, then the first (smaller k)."""
    return max(evaluations, key=lambda e: (e.goodput_per_s, e.saturation.rate_per_s))


def _evaluate_all(tasks: list[_Task], jobs: int) -> list[Evaluation]:
    if jobs <= 1 or len(tasks) <= 1:
        return [evaluate(task) for task in tasks]
    with ProcessPoolExecutor(min(jobs, len(tasks))) as pool:
        return list(pool.map(evaluate, tasks))


def targets_needed(rate_per_s: float, goodput_per_target: float) -> int:
    """Target workers that serve rate_per_s within the objective (at least 1)."""
    if goodput_per_target <= 0:
        return 0
    return max(1, math.ceil(rate_per_s / goodput_per_target))


def drafts_for(targets: int, evaluation: Evaluation) -> int:
    """Draft workers of a remote pool at the evaluation's ratio (at least 1); 0 otherwise."""
    if evaluation.cell.layout is not Layout.REMOTE:
        return 0
    return max(1, math.ceil(targets * evaluation.cell.ratio - 1e-9))
