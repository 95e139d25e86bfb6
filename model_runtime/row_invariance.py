"""Rows whose results never depend on the pass: the same bits at any width, batch or place.

Why: a verification pass over k + 1 tokens and a decoding pass over 1 run other kernels
(other tile shapes, other summation orders), so the same position can get logits that
differ in the last bits, and where the top two logits are that close the argmax flips:
greedy speculative output would then differ from target-only. Measured on SmolLM2-135M
through ModelSession (a pass of 8 new tokens against eight passes of 1): every row
differed in fp32 (at most 7e-5) and 54 of 64 in bf16, 3 argmaxes flipped.

A row-invariant model computes every row's result in an order fixed by the row alone:
- Linears run their rows in blocks (`InvariantLinear`): either blocks of exactly R rows,
  the last one padded (the same kernel and shape for every row, by construction), or
  chunks of at most R rows where the platform kernel was measured to give every row of
  every width 1..R the bits it gives the row alone (bf16 on AMX hosts: up to 32 rows,
  so decoding and verification run unpadded). Which kernel (plain, oneDNN-packed) and
  block is chosen per host and shape by measurement at start (`choose_linear`), cached
  per host, among the choices that are invariant; the choice is reported.
- Attention runs each row alone over exactly the keys it sees (`row_attention`): one
  query against its own prefix (or its tree path), the call a decoding step makes.
- Norms, rotary embeddings and activations are per row already (measured: 0 rows
  differ once the two above are invariant).

The price is measured per host and precision (benchmarks/results_row_invariance.md);
`apply_mode`'s auto turns it on where it costs little (docs/exactness.md).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from foundation.errors import InvalidArgument
from model_runtime.cpu_linear import PackedLinear, onednn_available

log = logging.getLogger(__name__)

ON, OFF, AUTO = "on", "off", "auto"
MODES = (AUTO, ON, OFF)
INVARIANT_ATTR = "specdec_row_invariant"  # on a model: the RowInvariance it runs with
PADDED_BLOCKS = (8, 16)  # fixed block sizes tried (rows); a decode step pays one block
MAX_NATIVE_ROWS = 64  # widest chunk tried unpadded
GPU_BLOCK = 16  # rows per block on a GPU: one cuBLAS shape for every row (not measured here)
TIMED_WIDTHS = (1, 9, 64)  # a decoding step, a verification of k = 8, a prefill chunk
PREFILL_WEIGHT = 1 / 8  # a 64-row chunk's cost counts as much as 8 tokens of decoding


@dataclass(frozen=True)
class LinearChoice:
    """How one linear shape runs invariantly on this host."""

    kernel: str  # "plain" (F.linear) or "packed" (oneDNN, fp32 CPU)
    block_rows: int  # rows per kernel call
    padded: bool  # True: every call has exactly block_rows rows; False: at most
    ms: tuple[float, ...] = ()  # [len(TIMED_WIDTHS)] time of a pass of each timed width, in ms
    fastest_ms: tuple[float, ...] = ()  # the same for the fastest kernel, invariant or not

    def describe(self) -> str:
        return f"{self.kernel} {'x' if self.padded else '<='}{self.block_rows}"

    def cost_ratio(self) -> float:
        """Decoding plus verification time against the fastest kernel's (1.0 = free)."""
        if not self.ms or not self.fastest_ms:
            return 1.0
        return (self.ms[0] + self.ms[1]) / (self.fastest_ms[0] + self.fastest_ms[1])


@dataclass(frozen=True)
class RowInvariance:
    """What a row-invariant model runs: its linears' choices by shape."""

    linears: dict  # "in x out" -> LinearChoice
    counts: dict  # "in x out" -> how many linears of the model have that shape

    def describe(self) -> str:
        kinds = sorted({choice.describe() for choice in self.linears.values()})
        return (
            f"linears {', '.join(kinds)}; attention per row; linear cost {self.cost_ratio():.2f}x"
        )

    def cost_ratio(self) -> float:
        """The model's linears' decoding plus verification time, invariant, against the
        fastest kernels' (1.0 = free; 1.0 where nothing was timed, as on a GPU)."""
        timed = [(self.counts[key], c) for key, c in self.linears.items() if c.ms and c.fastest_ms]
        if not timed:
            return 1.0
        invariant = sum(n * (c.ms[0] + c.ms[1]) for n, c in timed)
        return invariant / sum(n * (c.fastest_ms[0] + c.fastest_ms[1]) for n, c in timed)


class InvariantLinear(nn.Module):
    """nn.Linear whose every output row depends on its input row alone (see module doc)."""

    def __init__(self, linear: nn.Module, choice: LinearChoice):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.choice = choice
        # The weights stay the model's parameters (counted, moved, tied as before); a
        # packed kernel holds its own oneDNN copy.
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = PackedLinear(linear) if choice.kernel == "packed" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        return run_in_blocks(
            self._kernel, rows, self.choice.block_rows, self.choice.padded
        ).reshape(*x.shape[:-1], self.out_features)

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return (
            self.packed(rows) if self.packed is not None else F.linear(rows, self.weight, self.bias)
        )


def run_in_blocks(
    kernel: Callable, rows: torch.Tensor, block_rows: int, padded: bool
) -> torch.Tensor:
    """kernel over `rows` [n, in] in blocks of block_rows rows (the last padded with zeros
    to block_rows if `padded`) -> [n, out]."""
    n = rows.shape[0]
    if n == block_rows or (n < block_rows and not padded):
        return kernel(rows)
    outputs = []
    for start in range(0, n, block_rows):
        block = rows[start : start + block_rows]
        if padded and block.shape[0] < block_rows:
            block = F.pad(block, (0, 0, 0, block_rows - block.shape[0]))
        outputs.append(kernel(block)[: min(block_rows, n - start)])
    return torch.cat(outputs)


def _kernel(linear: nn.Module, name: str) -> Callable:
    if name == "packed":
        return PackedLinear(linear)
    weight, bias = linear.weight, linear.bias
    return lambda x: F.linear(x, weight, bias)


def row_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    parents: list[int] | None,
    scaling: float | None,
) -> torch.Tensor:
    """Each new token's attention alone, over exactly the positions it sees.

    query `[1, num_heads, t, head_dim]` for the t new tokens; keys and values
    `[num_kv_heads, start + t, head_dim]` (the cache up to the last new token); parents as
    Segment.parents (None: a chain). Returns `[t, num_heads, head_dim]`. Row j's call is
    the one a decoding step makes for it: one query, its visible keys in position order,
    no mask."""
    t = query.shape[2]
    gqa = query.shape[1] != keys.shape[0]
    output = query.new_empty(t, query.shape[1], query.shape[3])
    visible = _visible_positions(start, parents) if parents is not None else None
    for j in range(t):
        if visible is None:
            row_keys, row_values = keys[:, : start + j + 1], values[:, : start + j + 1]
        else:
            index = visible[j].to(keys.device)
            row_keys, row_values = keys.index_select(1, index), values.index_select(1, index)
        attended = F.scaled_dot_product_attention(
            query[:, :, j : j + 1],
            row_keys.unsqueeze(0),
            row_values.unsqueeze(0),
            scale=scaling,
            enable_gqa=gqa,
        )
        output[j] = attended[0, :, 0]
    return output


def _visible_positions(start: int, parents: list[int]) -> list[torch.Tensor]:
    """For each new token of a tree: the cached positions, its ancestors and itself, ascending."""
    chains: list[list[int]] = []
    for j, parent in enumerate(parents):
        chains.append((chains[parent] if parent >= 0 else []) + [start + j])
    return [torch.cat([torch.arange(start), torch.tensor(chain)]) for chain in chains]


def plan_row_invariance(
    model: nn.Module, choose: Callable[[nn.Linear], LinearChoice] | None = None
) -> RowInvariance:
    """Each linear shape's choice (default `choose_linear`: measured and cached per host);
    changes nothing."""
    choose = choose or choose_linear
    choices: dict[str, LinearChoice] = {}
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            key = _shape_key(module)
            counts[key] = counts.get(key, 0) + 1
            if key not in choices:
                choices[key] = choose(module)
    return RowInvariance(choices, counts)


def make_row_invariant(model: nn.Module, invariance: RowInvariance | None = None) -> RowInvariance:
    """Replaces every nn.Linear of `model` by an InvariantLinear (in place) and marks the
    model so that its passes attend per row (batched_forward)."""
    invariance = invariance or plan_row_invariance(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, InvariantLinear(child, invariance.linears[_shape_key(child)]))
    setattr(model, INVARIANT_ATTR, invariance)
    log.info("row-invariant passes: %s", invariance.describe())
    return invariance


def _shape_key(linear: nn.Linear) -> str:
    return f"{linear.in_features}x{linear.out_features}{'+bias' if linear.bias is not None else ''}"


def invariance_of(model: nn.Module) -> RowInvariance | None:
    return getattr(model, INVARIANT_ATTR, None)


def apply_mode(model: nn.Module, mode: str) -> RowInvariance | None:
    """Makes a loaded model row-invariant as `mode` says; returns what it runs (None: off).

    auto: on for half precision on a CPU, where it costs little (bf16: 1.02-1.16x a
    session's step, measured) and where rows differ enough to flip greedy tokens; off in
    fp32 (1.2-1.3x, and rows differ only in the last bits) and on GPUs until the GPU check
    has priced it there (docs/exactness.md)."""
    if mode not in MODES:
        raise InvalidArgument(f"row invariance must be one of {', '.join(MODES)}, got {mode!r}")
    parameter = next(model.parameters())
    if mode == OFF or (
        mode == AUTO and (parameter.device.type != "cpu" or parameter.dtype == torch.float32)
    ):
        return None
    return make_row_invariant(model, plan_row_invariance(model))


# -- choosing a linear's kernel and block per host -------------------------------------


def choose_linear(linear: nn.Linear) -> LinearChoice:
    """The fastest invariant way to run `linear`'s shape here, from the host's cache or
    measured now (a few seconds for a large shape) and cached."""
    weight = linear.weight
    if weight.device.type != "cpu":
        return LinearChoice("plain", GPU_BLOCK, padded=True)
    key = _cache_key(linear)
    cache = _load_cache()
    if key in cache:
        entry = cache[key]
        return LinearChoice(
            entry["kernel"],
            entry["block_rows"],
            entry["padded"],
            tuple(entry["ms"]),
            tuple(entry["fastest_ms"]),
        )
    choice = measure_linear(linear)
    cache[key] = asdict(choice)
    _save_cache(cache)
    log.info("linear %s: %s", key, choice.describe())
    return choice


@torch.inference_mode()
def measure_linear(linear: nn.Linear, seed: int = 0) -> LinearChoice:
    """Times every candidate (kernels x blocks) at TIMED_WIDTHS; keeps the invariant ones."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(2 * MAX_NATIVE_ROWS, linear.in_features, generator=generator).to(
        linear.weight.dtype
    )
    kernels = {"plain": _kernel(linear, "plain")}
    if linear.weight.dtype == torch.float32 and onednn_available():
        kernels["packed"] = _kernel(linear, "packed")
    candidates = []
    fastest = None
    for name, kernel in kernels.items():
        ms = _time_widths(lambda x, k=kernel: k(x), rows)  # the kernel as it is: not invariant
        fastest = ms if fastest is None or sum(ms[:2]) < sum(fastest[:2]) else fastest
        native = native_invariant_rows(kernel, rows)
        if native >= min(PADDED_BLOCKS):
            candidates.append(
                LinearChoice(name, native, False, _time_blocks(kernel, rows, native, False))
            )
        for block in PADDED_BLOCKS:
            if padded_is_invariant(kernel, rows, block):
                candidates.append(
                    LinearChoice(name, block, True, _time_blocks(kernel, rows, block, True))
                )
    # one row at a time: the width-1 kernel for every row, invariant by construction
    if not candidates:
        candidates.append(
            LinearChoice("plain", 1, True, _time_blocks(kernels["plain"], rows, 1, True))
        )
    best = min(candidates, key=_score)
    return LinearChoice(best.kernel, best.block_rows, best.padded, best.ms, tuple(fastest))


def native_invariant_rows(kernel: Callable, rows: torch.Tensor) -> int:
    """The largest w <= MAX_NATIVE_ROWS such that calls of every width 1..w give each row
    the bits its call alone gives (rows at every place of a call: two calls per width)."""
    alone = torch.cat([kernel(rows[i : i + 1]) for i in range(rows.shape[0])])
    for width in range(2, MAX_NATIVE_ROWS + 1):
        together = torch.cat([kernel(rows[i : i + width]) for i in (0, width)])
        if not torch.equal(together, alone[: 2 * width]):
            return width - 1
    return MAX_NATIVE_ROWS


def padded_is_invariant(kernel: Callable, rows: torch.Tensor, block: int) -> bool:
    """Whether a row gives the same bits at every place of a block, whatever shares it."""
    alone = torch.cat(
        [run_in_blocks(kernel, rows[i : i + 1], block, True) for i in range(2 * block)]
    )
    together = run_in_blocks(kernel, rows[: 2 * block], block, True)
    shifted = run_in_blocks(kernel, rows[1 : 2 * block + 1], block, True)
    return torch.equal(together, alone) and torch.equal(shifted[: 2 * block - 1], alone[1:])


def _score(choice: LinearChoice) -> float:
    one, verify, chunk = choice.ms
    return one + verify + PREFILL_WEIGHT * chunk


def _time_blocks(
    kernel: Callable, rows: torch.Tensor, block: int, padded: bool
) -> tuple[float, ...]:
    return _time_widths(lambda x: run_in_blocks(kernel, x, block, padded), rows)


def _time_widths(fn: Callable, rows: torch.Tensor, repeats: int = 5) -> tuple[float, ...]:
    """Median ms of fn over the first w rows, for each of TIMED_WIDTHS (after one untimed call)."""
    result = []
    for width in TIMED_WIDTHS:
        x = rows[:width]
        fn(x)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn(x)
            samples.append((time.perf_counter() - start) * 1e3)
        result.append(round(statistics.median(samples), 4))
    return tuple(result)


def _cache_key(linear: nn.Linear) -> str:
    bias = "+bias" if linear.bias is not None else ""
    return (
        f"{_cpu_name()}|torch {torch.__version__}|threads {torch.get_num_threads()}|"
        f"{str(linear.weight.dtype).removeprefix('torch.')}|{linear.in_features}x{linear.out_features}{bias}"
    )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_path() -> str:
    """Where choices are cached: SPECULATIVE_KERNEL_CACHE, else beside the model cache."""
    from model_runtime.loading import model_cache_dir

    return os.environ.get("SPECULATIVE_KERNEL_CACHE") or str(
        model_cache_dir() / "row_invariant_linears.json"
    )


def _load_cache() -> dict:
    try:
        with open(cache_path()) as file:
            return json.load(file)
    except (OSError, ValueError):
        return {}


def _save_cache(cache: dict) -> None:
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as file:
            json.dump(cache, file, indent=1, sort_keys=True)
        os.replace(path + ".tmp", path)
    except OSError as error:  # a read-only cache: measured again next start
        log.warning("cannot cache linear choices at %s: %s", path, error)
