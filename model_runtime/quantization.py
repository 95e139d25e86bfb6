"""Cheap drafts: a model's linears quantized where that makes drafting cheaper.

A draft's numerics never change the output (the target decides every token), so a
draft may be quantized as hard as its acceptance allows. One setting names the scheme;
the device picks the kernel that runs it fast:

| scheme | CPU (x86) | CUDA |
| --- | --- | --- |
| `none` | fp32 linears packed for oneDNN (cpu_linear.py) | the model as loaded |
| `int8-dynamic` | int8 weights per output channel, activations per call (fbgemm) | torchao int8 |
| `int8-dynamic-per-tensor` | the same, one scale per weight matrix | refused: use `int8-dynamic` |
| `int8-weight-only`, `int4-weight-only` | refused: no fast CPU kernel | torchao weight-only int8 / int4 |
| `fp8` | refused: no fast CPU kernel | torchao fp8 weights and activations |

Measured here (2-core EPYC, benchmarks/results/archive/results_drafts.md): torchao's int8 schemes run
5-10x slower than fp32 on this CPU, while torch's dynamic quantization (fbgemm) runs
2.5x faster. So the CPU path is `torch.ao.quantization.quantize_dynamic`, deprecated in
favour of torchao but the only fast one here; it stays behind `quantize` alone.

`keep_output_layer`: the output layer (vocabulary-sized, a quarter of a 0.5B model's
weights) decides which token wins, so it may stay in full precision at some cost.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from foundation.errors import InvalidArgument

if TYPE_CHECKING:  # torch is imported where a model is quantized: configs check names without it
    from torch import nn

log = logging.getLogger(__name__)

NONE = "none"
# The `self` drafter: the target's own weights as draft, quantized (unquantized it would
# cost as much as the target).
SELF_DRAFT = "self"
SELF_QUANTIZATION = "int8-dynamic"


def resolve_draft(model: str, quantization: str, target_model: str) -> tuple[str, str]:
    """(model, scheme) of a draft named `model` ('self': the target's) with `quantization`
    ('': the default, SELF_QUANTIZATION for 'self', none otherwise)."""
    if model == SELF_DRAFT:
        return target_model, quantization or SELF_QUANTIZATION
    return model, quantization or NONE


@dataclass(frozen=True)
class Scheme:
    cpu: str | None  # how the CPU runs it ("fbgemm-per-channel", ...), None: refused there
    cuda: str | None  # the torchao config that runs it on CUDA, None: refused there
    why_not_cpu: str = ""
    cuda_args: tuple[tuple[str, object], ...] = ()  # the config's arguments


# torchao's default int4 layout needs the separate `mslk` kernels package; the tiled
# layout runs torch's own int4 matmul (tinygemm) on bf16 models.
INT4_CUDA_ARGS = (("group_size", 128), ("int4_packing_format", "tile_packed_to_4d"))


SCHEMES = {
    NONE: Scheme(cpu="none", cuda="none"),
    "int8-dynamic": Scheme(cpu="fbgemm-per-channel", cuda="Int8DynamicActivationInt8WeightConfig"),
    "int8-dynamic-per-tensor": Scheme(cpu="fbgemm-per-tensor", cuda=None),
    "int8-weight-only": Scheme(
        cpu=None,
        cuda="Int8WeightOnlyConfig",
        why_not_cpu="torchao's int8 weight-only kernel is 5-7x slower than fp32 on CPU",
    ),
    "int4-weight-only": Scheme(
        cpu=None,
        cuda="Int4WeightOnlyConfig",
        cuda_args=INT4_CUDA_ARGS,
        why_not_cpu="torchao's int4 weight-only kernel needs CUDA",
    ),
    "fp8": Scheme(
        cpu=None,
        cuda="Float8DynamicActivationFloat8WeightConfig",
        why_not_cpu="fp8 matmuls need a CUDA GPU with fp8 support (Ada, Hopper or newer)",
    ),
}


def check_scheme(scheme: str, device: str = "cpu") -> Scheme:
    """The scheme's entry; InvalidArgument for an unknown scheme or one this device
    cannot run fast."""
    if scheme not in SCHEMES:
        raise InvalidArgument(f"quantization must be one of {list(SCHEMES)}, got {scheme!r}")
    entry = SCHEMES[scheme]
    on_cuda = device.partition(":")[0] == "cuda"
    if on_cuda and entry.cuda is None:
        raise InvalidArgument(
            f"quantization {scheme!r} runs on CPU only; on CUDA use 'int8-dynamic'"
        )
    if not on_cuda and entry.cpu is None:
        raise InvalidArgument(
            f"quantization {scheme!r} is for CUDA: {entry.why_not_cpu}; on CPU use 'int8-dynamic'"
        )
    return entry


def quantize(model: nn.Module, scheme: str, keep_output_layer: bool = False) -> nn.Module:
    """The model with its linears quantized by `scheme` (in place where the kernel
    allows); `none` returns it unchanged. Inference only."""
    parameter = next(model.parameters())
    entry = check_scheme(scheme, str(parameter.device))
    if scheme == NONE:
        return model
    skip = _output_layer_names(model) if keep_output_layer else set()
    if parameter.device.type == "cuda":
        _quantize_torchao(model, torchao_config(entry), skip)
    else:
        model = _quantize_fbgemm(model, per_channel=entry.cpu == "fbgemm-per-channel", skip=skip)
    log.info("quantized linears: %s%s", scheme, " (output layer kept)" if skip else "")
    return model


def _output_layer_names(model: nn.Module) -> set[str]:
    """Where the output layer sits (module names), so that it can be left alone."""
    output = model.get_output_embeddings()
    return {name for name, module in model.named_modules() if module is output}


def _quantize_fbgemm(model: nn.Module, per_channel: bool, skip: set[str]) -> nn.Module:
    import torch
    from torch import nn

    if model.dtype != torch.float32:
        raise InvalidArgument(
            f"int8 dynamic quantization on CPU starts from float32 weights, got {model.dtype}"
        )
    from torch.ao.quantization import (
        default_dynamic_qconfig,
        per_channel_dynamic_qconfig,
        quantize_dynamic,
    )

    torch.backends.quantized.engine = (
        "fbgemm"
        if "fbgemm" in torch.backends.quantized.supported_engines
        else torch.backends.quantized.engine
    )
    qconfig = per_channel_dynamic_qconfig if per_channel else default_dynamic_qconfig
    spec = {
        name: qconfig
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name not in skip
    }
    with warnings.catch_warnings():  # torch.ao.quantization's deprecation: see the module docstring
        for category in (DeprecationWarning, FutureWarning, UserWarning):
            warnings.simplefilter("ignore", category)
        return quantize_dynamic(model, spec, dtype=torch.qint8, inplace=True)


def torchao_config(entry: Scheme):
    """The torchao config object that runs `entry` on CUDA."""
    try:
        import torchao.quantization as torchao_quantization
    except ImportError:
        raise InvalidArgument("quantization on CUDA needs torchao: pip install '.[gpu]'") from None
    return getattr(torchao_quantization, entry.cuda)(**dict(entry.cuda_args))


def _quantize_torchao(model: nn.Module, config, skip: set[str]) -> None:
    import torchao.quantization as torchao_quantization
    from torch import nn

    torchao_quantization.quantize_(
        model,
        config,
        filter_fn=lambda module, name: isinstance(module, nn.Linear) and name not in skip,
    )
