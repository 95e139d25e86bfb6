"""The draft worker's small model, started: loaded and warmed up on its compute thread,
where every forward pass of the model then runs, the drafting steps of all sessions
batched into one pass per step (model_runtime/step_scheduler.py).

The one module of the draft worker that imports torch and transformers: the server
imports it only when the worker has a model (`--model`), so that a worker serving the
n-gram drafter alone starts without them (seconds on a 2-core machine).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from draft_service.config import DraftConfig
from model_runtime import static_passes, warmup
from model_runtime.host_memory import fix_mmap_threshold
from model_runtime.loading import LoadedModel, configure_threads, load_model
from model_runtime.step_scheduler import StepScheduler
from speculative.drafter_base import DEFAULT_DRAFT_TOP_K
from speculative.drafters import ModelDrafter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftModel:
    """The model, its drafter ("model"), and the step scheduler its passes run on."""

    loaded: LoadedModel
    drafter: ModelDrafter
    compute: StepScheduler

    @classmethod
    def of(
        cls,
        loaded: LoadedModel,
        draft_top_k: int = DEFAULT_DRAFT_TOP_K,
        compute: StepScheduler | None = None,
    ) -> DraftModel:
        """A loaded model as the worker's drafter; a new step scheduler unless given one."""
        compute = compute or StepScheduler(loaded.model, name="draft-compute")
        return cls(loaded, ModelDrafter(loaded, draft_top_k), compute)


def start_draft_model(config: DraftConfig, loaded: LoadedModel | None = None) -> DraftModel:
    """Loads config.model (unless `loaded` is given: tests share one), and warms it up
    where that pays, on the thread that will run its passes."""
    fix_mmap_threshold()  # steps of ever-changing sizes must not fragment the heap
    compute = StepScheduler(name="draft-compute")
    compute.run(configure_threads, config.threads or None)
    if loaded is None:
        loaded = compute.run(
            load_model,
            config.model,
            device=config.device,
            dtype=config.dtype,
            quantize=config.quantization,
            keep_output_layer=config.keep_output_layer,
        )
    compute.model = loaded.model
    compute.run(
        static_passes.install,
        loaded.model,
        config.static_passes,
        config.static_slots,
        min(config.static_capacity, loaded.context_length),
    )
    if warmup.pays_off(loaded):
        log.info("warmed up in %.2f s", compute.run(warmup.warm_up, loaded) * 1e-9)
    return DraftModel.of(loaded, config.draft_top_k, compute)
