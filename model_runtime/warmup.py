"""One pass of every width a round can ask for, before the first request, where that pays.

On a GPU the first forward pass at a new number of tokens is slow: CUDA loads kernels
and grows its caching allocator. A worker that skipped this would make its first
requests pay for it, and an adaptive call (speculative/policy.py) would measure one-off
costs as the price of a width. Warming up costs one short prefill and `max_width` small
passes.

On a CPU it does not pay, measured on SmolLM2-135M (fp32, oneDNN linears, 2 cores): the
first pass of each width 1..17 took no longer than the later ones (the differences sum
to 0.2 s over all 17 widths, within the noise; the first prefill as long as the
second), while warming them all took 5 s on one thread and 31 s on two threads of a
busy machine, the larger part of a worker's start. CPU workers start without it.
"""

from __future__ import annotations

import time

from foundation.limits import MAX_SPECULATIVE_TOKENS
from model_runtime.loading import LoadedModel
from model_runtime.model_session import ModelSession

PROMPT_LEN = 16  # tokens of context the passes extend: attention over a short cache


def pays_off(loaded: LoadedModel) -> bool:
    """Whether warm_up buys more than it costs on the model's device (see above)."""
    return loaded.device.type != "cpu"


def warm_up(loaded: LoadedModel, max_width: int = MAX_SPECULATIVE_TOKENS + 1) -> int:
    """Runs one pass of each width 1..max_width; returns the time taken, in ns."""
    start = time.perf_counter_ns()
    max_width = min(max_width, loaded.context_length - PROMPT_LEN - 1)
    session = ModelSession(loaded.model, loaded.context_length)
    session.append([0] * PROMPT_LEN)
    session.prefill()
    for width in range(1, max_width + 1):
        session.append([0] * width)
        session.logits(width)
        session.truncate_to(PROMPT_LEN)
    session.release()
    return time.perf_counter_ns() - start
