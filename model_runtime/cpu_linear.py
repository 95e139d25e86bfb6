"""Faster fp32 linears on CPU for verification passes of a few tokens.

With MKL, `F.linear` over 2-8 rows costs about 2x one row, so verifying k draft tokens
costs nearly two decode steps and eats the gain of speculation. oneDNN with weights
pre-packed for a small batch brings a 5-token pass to about 1.35x one token, measured on
SmolLM2-135M on this project's 2-core machine (scratch study, 1 thread). It is the same
fp32 arithmetic in another summation order; every row's result is independent of how
many rows run with it.

The packed weights are opaque oneDNN tensors: a packed model cannot be copied, moved to
another device or saved, so packing is the last step of loading. It cannot be kept
between starts either, and it costs a warm start of Qwen2.5-Coder-1.5B 7-10 s (6.6 GB
read and reordered); a worker may serve first and pack after (`pack_in_jobs`), one
linear per job of its step scheduler, running the plain kernel meanwhile: the same fp32
arithmetic in another summation order, as a pass of another width already is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)

# Rows the packing is tuned for: verification passes of k + 1 = 2..9 tokens.
PACKING_BATCH_HINT = 8


def onednn_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """nn.Linear computed by oneDNN on pre-packed weights (fp32, CPU, inference only)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = PACKING_BATCH_HINT):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().contiguous()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def should_pack(model: nn.Module) -> bool:
    """Whether packing pays: an fp32 model on a CPU with oneDNN (GPUs and half precision
    have their own fast paths)."""
    parameter = next(model.parameters())
    return (
        parameter.device.type == "cpu" and parameter.dtype == torch.float32 and onednn_available()
    )


def pack_linears(model: nn.Module) -> int:
    """Replaces every nn.Linear of an fp32 CPU model in place; returns how many (0 where
    should_pack says no)."""
    return pack_in_jobs(model, lambda fn, *args: fn(*args))


def pack_in_jobs(model: nn.Module, run: Callable) -> int:
    """pack_linears, each linear one call of `run(fn, *args)` (a step scheduler's run:
    between the steps of requests being served, each swapping one module)."""
    if not should_pack(model):
        return 0
    linears = [
        (parent, name, child)
        for parent in list(model.modules())
        for name, child in list(parent.named_children())
        if isinstance(child, nn.Linear)
    ]
    for parent, name, child in linears:
        run(_pack_one, parent, name, child)
    log.info("packed %d linear layers for oneDNN", len(linears))
    return len(linears)


def _pack_one(parent: nn.Module, name: str, linear: nn.Linear) -> None:
    setattr(parent, name, PackedLinear(linear))
