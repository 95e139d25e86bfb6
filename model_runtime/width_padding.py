"""Small steps run at the cheapest width: a pass over a few more rows can cost less.

On a CPU the linear kernels are chosen by row count, and their speed is not monotone in
it: on this project's machine (2-core AMD EPYC, oneDNN-packed fp32 linears) a pass of
Qwen2.5-Coder-1.5B over 256 cached tokens took 230 ms for 1 new token, 290 ms for 2 and
180 ms for 5. A worker times one pass of each width up to MAX_WIDTH at start
(`calibrate`) and then runs a step of w rows at the cheapest width w' >= w
(`WidthPlan.width`); the extra rows are padding, which batched_forward already runs for
wide CPU steps: they attend to nothing and give no logits, and every real row's result
is its own (cpu_linear.py), so outputs do not change. A width is taken only when it is
cheaper by MARGIN, so timing noise does not pad. Not on GPUs (kernels there are
monotone enough; warmup.py covers their first-pass costs).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from transformers import PreTrainedModel

from model_runtime.batched_forward import EXACT_ROWS, WIDTHS_ATTR

MAX_WIDTH = 12  # calibrated widths: a round's proposal plus its token, for k up to 11
assert MAX_WIDTH <= EXACT_ROWS  # wider steps are padded by their own rule
MARGIN = 0.9  # a wider step is taken only below this share of the narrower one's time
PREFIX = 64  # cached tokens under the timed passes
REPEATS = 3  # timed passes per width (median), after one untimed


@dataclass(frozen=True)
class WidthPlan:
    """The width each step of 1..MAX_WIDTH rows runs at."""

    run_as: tuple[int, ...]  # [rows - 1] the width to run
    costs_ms: tuple[float, ...] = ()  # [rows - 1] what a step of that many rows costs, run so

    @classmethod
    def from_costs(cls, costs: dict[int, float]) -> WidthPlan:
        """For each width, the cheapest at least as wide, wider only where it saves 1 - MARGIN."""
        widths = sorted(costs)
        run_as = []
        for rows in widths:
            best = rows
            for wider in widths:
                if wider > rows and costs[wider] < MARGIN * costs[best]:
                    best = wider
            run_as.append(best)
        return cls(tuple(run_as), tuple(costs[width] for width in run_as))

    def width(self, rows: int) -> int:
        return self.run_as[rows - 1] if rows <= len(self.run_as) else rows


def pass_times(
    model: PreTrainedModel, widths, prefix: int = PREFIX, repeats: int = REPEATS, untimed: int = 1
) -> dict[int, float]:
    """Median ms of a pass of each width over `prefix` cached tokens (the worker's path:
    a ModelSession's pending tokens), after `untimed` passes of that width."""
    from model_runtime.model_session import ModelSession

    session = ModelSession(model, prefix + max(widths) + 1)
    session.append([1 + i % 200 for i in range(prefix + 1)])
    session.prefill()
    session.truncate_to(prefix)
    costs = {}
    for width in widths:
        samples = []
        for repeat in range(repeats + untimed):
            session.append([2 + (repeat + j) % 200 for j in range(width)])
            start = time.perf_counter()
            session.logits(width)
            samples.append((time.perf_counter() - start) * 1e3)
            session.truncate_to(prefix)
        costs[width] = statistics.median(samples[untimed:])
    session.release()
    return costs


def calibrate(model: PreTrainedModel, max_width: int = MAX_WIDTH) -> dict[int, float]:
    """Times a pass of each width 1..max_width (ms, median) and installs the plan on the model."""
    setattr(model, WIDTHS_ATTR, None)  # time the widths as they are
    costs = pass_times(model, range(1, max_width + 1))
    setattr(model, WIDTHS_ATTR, WidthPlan.from_costs(costs))
    return costs


def plan_of(model: PreTrainedModel) -> WidthPlan | None:
    return getattr(model, WIDTHS_ATTR, None)


def step_costs(model: PreTrainedModel) -> tuple[float, ...]:
    """What a step of 1..MAX_WIDTH rows costs as it runs, in ms (empty: not calibrated),
    as the worker tells callers that price its steps (ModelInfo.step_ms)."""
    plan = plan_of(model)
    return plan.costs_ms if plan is not None else ()
