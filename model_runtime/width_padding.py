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

The timings are kept per host (host_measurements.py), keyed by the model's config,
dtype and how its linears run: a restart installs them at once (`install_kept`), where
timing them took 13-17 s of a Qwen2.5-Coder-1.5B target's start. A worker that finds
none serves at once, every width as it is (the prior), and times the widths after,
one width per job of its step scheduler (`calibrate_in_jobs`), so requests interleave.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedModel

from model_runtime import host_measurements
from model_runtime.batched_forward import EXACT_ROWS, WIDTHS_ATTR
from model_runtime.cpu_linear import PackedLinear
from model_runtime.row_invariance import invariance_of

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
    session = _timing_session(model, prefix, max(widths))
    costs = {width: _time_width(session, width, prefix, repeats, untimed) for width in widths}
    session.release()
    return costs


def _timing_session(model: PreTrainedModel, prefix: int, max_width: int):
    from model_runtime.model_session import ModelSession

    session = ModelSession(model, prefix + max_width + 1)
    session.append([1 + i % 200 for i in range(prefix + 1)])
    session.prefill()
    session.truncate_to(prefix)
    return session


def _time_width(session, width: int, prefix: int, repeats: int, untimed: int) -> float:
    samples = []
    for repeat in range(repeats + untimed):
        session.append([2 + (repeat + j) % 200 for j in range(width)])
        start = time.perf_counter()
        session.logits(width)
        samples.append((time.perf_counter() - start) * 1e3)
        session.truncate_to(prefix)
    return statistics.median(samples[untimed:])


def calibrate(model: PreTrainedModel, max_width: int = MAX_WIDTH) -> dict[int, float]:
    """Times a pass of each width 1..max_width (ms, median), installs the plan on the
    model and keeps the timings for this host."""
    return calibrate_in_jobs(model, lambda fn, *args: fn(*args), max_width)


def calibrate_in_jobs(
    model: PreTrainedModel, run: Callable, max_width: int = MAX_WIDTH
) -> dict[int, float]:
    """calibrate, each width's passes one call of `run(fn, *args)` (the step scheduler's
    run: between steps of the requests being served). The model runs every width as it
    is meanwhile."""
    setattr(model, WIDTHS_ATTR, None)  # time the widths as they are
    session = run(_timing_session, model, PREFIX, max_width)
    costs = {
        width: run(_time_width, session, width, PREFIX, REPEATS, 1)
        for width in range(1, max_width + 1)
    }
    run(session.release)
    _install(model, costs)
    return costs


def install_kept(model: PreTrainedModel) -> bool:
    """Installs the plan from this host's kept timings of this model; False: none kept."""
    entry = host_measurements.lookup("widths", measurement_key(model))
    if entry is None:
        return False
    setattr(model, WIDTHS_ATTR, WidthPlan.from_costs({int(w): ms for w, ms in entry.items()}))
    return True


def measurement_key(model: PreTrainedModel) -> str:
    """The model's shapes, dtype and linears' kernels: what a pass's cost depends on
    besides the host (which host_measurements keys)."""
    config = hashlib.sha256(model.config.to_json_string().encode()).hexdigest()[:16]
    invariance = invariance_of(model)
    if invariance is not None:
        kernels = "invariant " + ",".join(
            sorted({c.describe() for c in invariance.linears.values()})
        )
    else:
        packed = any(isinstance(module, PackedLinear) for module in model.modules())
        kernels = "packed" if packed else "plain"
    return f"{config}|{str(model.dtype).removeprefix('torch.')}|{kernels}"


def _install(model: PreTrainedModel, costs: dict[int, float]) -> None:
    setattr(model, WIDTHS_ATTR, WidthPlan.from_costs(costs))
    host_measurements.remember(
        "widths", measurement_key(model), {str(w): ms for w, ms in costs.items()}
    )


def plan_of(model: PreTrainedModel) -> WidthPlan | None:
    return getattr(model, WIDTHS_ATTR, None)


def step_costs(model: PreTrainedModel) -> tuple[float, ...]:
    """What a step of 1..MAX_WIDTH rows costs as it runs, in ms (empty: not calibrated),
    as the worker tells callers that price its steps (ModelInfo.step_ms)."""
    plan = plan_of(model)
    return plan.costs_ms if plan is not None else ()
