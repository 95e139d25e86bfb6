"""Rows whose results never depend on the pass: the same bits at any width, batch or place.

Why: a verification pass over k + 1 tokens and a decoding pass over 1 run other kernels
(other tile shapes, other summation orders), so the same position can get logits that
differ in the last bits, and where the top two logits are that close the argmax flips:
greedy speculative output would then differ from target-only. Measured on SmolLM2-135M
through ModelSession (a pass of 8 new tokens against eight passes of 1): every row
differed in fp32 (at most 7e-5) and 54 of 64 in bf16, 3 argmaxes flipped.

A row-invariant model computes every row's result in an order fixed by the row alone:
- Linears run their rows in blocks of exactly R rows (`InvariantLinear`), each block
  copied into a fresh zero-padded buffer: every kernel call has one shape, one layout
  and one alignment, whatever the pass. A blocked GEMM (oneDNN, MKL) plans its
  tiling and its reduction over K from the call's shape, never from the values, and
  runs one K order for every row tile, so a row gets the same bits at every place of a
  block and beside any rows. What is not used: a host's kernel unpadded at several
  widths, even where a probe finds it invariant (on an AMD EPYC host plain bf16
  `F.linear` sums K in another order at one row than at two or more: 43 of 512 rows
  differ, and a probe of a few random rows passed it).
- A probe checks the construction on every host before a block is used
  (`probe_blocks`): inputs built so that any change in a row's summation order changes
  its output (a cancelling pair of 2^26 among +-1 terms: the terms summed between the
  pair are lost to rounding), each row at every place of a block beside other rows,
  against the row alone. Its power, measured on a kernel known to sum in another order
  at another width: 64 of 64 rows caught, 79-92% of their outputs differ, where random
  normal rows caught 5 of 64 (docs/exactness.md). A block that fails is never used or
  cached; R (and the kernel: plain, oneDNN-packed) is chosen per host and shape by
  timing the blocks that pass (`choose_linear`), cached per host.
- Attention runs each row alone over exactly the keys it sees (`row_attention`): one
  query against its own prefix (or its tree path), the call a decoding step makes.
- Norms, rotary embeddings and activations are per row already (measured: 0 rows
  differ once the two above are invariant).

The price is measured per host and precision (benchmarks/results/row_invariance.md);
`apply_mode`'s auto turns it on where it costs little (docs/exactness.md).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from foundation.errors import InvalidArgument
from model_runtime import host_measurements
from model_runtime.cpu_linear import PackedLinear, onednn_available

log = logging.getLogger(__name__)

ON, OFF, AUTO = "on", "off", "auto"
MODES = (AUTO, ON, OFF)
INVARIANT_ATTR = "specdec_row_invariant"  # on a model: the RowInvariance it runs with
BLOCK_ROWS = (4, 8, 16)  # block sizes tried (rows); a decoding step pays one block
GPU_BLOCK = 16  # rows per block on a GPU: one cuBLAS shape for every row (not measured here)
TIMED_WIDTHS = (1, 9, 64)  # a decoding step, a verification of k = 8, a prefill chunk
PREFILL_WEIGHT = 1 / 8  # a 64-row chunk's cost counts as much as 8 tokens of decoding
PROBE_ROWS = 16  # designed rows the probe puts at each place of a block
CANCELLING = 2.0**26  # the probe's cancelling pair, against terms of 1: lost beside it in fp32


@dataclass(frozen=True)
class LinearChoice:
    """How one linear shape runs invariantly on this host: blocks of exactly block_rows."""

    kernel: str  # "plain" (F.linear) or "packed" (oneDNN, fp32 CPU)
    block_rows: int  # rows of every kernel call (the last block of a pass zero-padded)
    ms: tuple[float, ...] = ()  # [len(TIMED_WIDTHS)] time of a pass of each timed width, in ms
    fastest_ms: tuple[float, ...] = ()  # the same for the fastest kernel, invariant or not

    def describe(self) -> str:
        return f"{self.kernel} x{self.block_rows}"

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
        return run_in_blocks(self._kernel, rows, self.choice.block_rows).reshape(
            *x.shape[:-1], self.out_features
        )

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return (
            self.packed(rows) if self.packed is not None else F.linear(rows, self.weight, self.bias)
        )


def run_in_blocks(kernel: Callable, rows: torch.Tensor, block_rows: int) -> torch.Tensor:
    """kernel over `rows` [n, in] -> [n, out], one call per block of block_rows rows, each
    block copied into a fresh zero-padded buffer [block_rows, in]: every call has the same
    shape, strides and alignment (the allocator's), whatever the pass."""
    outputs = []
    for start in range(0, rows.shape[0], block_rows):
        used = min(block_rows, rows.shape[0] - start)
        block = rows.new_zeros(block_rows, rows.shape[1])
        block[:used] = rows[start : start + used]
        outputs.append(kernel(block)[:used])
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


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

    auto: on for half precision on a CPU, where rows differ enough to flip greedy tokens
    (a near-tie within a bf16 step) and where the target runs bf16 by default only with
    AMX; off in fp32 (1.2-2x a step, and rows differ only in the last bits) and on GPUs
    until the GPU check has priced it there (docs/exactness.md, the price per host)."""
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
    """The fastest invariant way to run `linear`'s shape here, from the host's
    measurements (host_measurements.py) or measured now (seconds for a large shape)."""
    weight = linear.weight
    if weight.device.type != "cpu":
        return LinearChoice("plain", GPU_BLOCK)
    key = _shape_key(linear) + f"|{str(weight.dtype).removeprefix('torch.')}"
    entry = host_measurements.lookup("linear", key)
    if entry is not None:
        return LinearChoice(
            entry["kernel"], entry["block_rows"], tuple(entry["ms"]), tuple(entry["fastest_ms"])
        )
    choice, probed = measure_linear(linear)
    if probed:  # a fallback, chosen because every block failed its probe, is not kept
        host_measurements.remember("linear", key, asdict(choice))
    log.info("linear %s: %s", key, choice.describe())
    return choice


@torch.inference_mode()
def measure_linear(linear: nn.Linear, seed: int = 0) -> tuple[LinearChoice, bool]:
    """Probes every candidate (kernels x blocks), times those that pass at TIMED_WIDTHS
    and returns the fastest, and whether any passed (else: one row per call)."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(TIMED_WIDTHS[-1], linear.in_features, generator=generator).to(
        linear.weight.dtype
    )
    kernels = ["plain"]
    if linear.weight.dtype == torch.float32 and onednn_available():
        kernels.append("packed")
    candidates, fastest = [], None
    for name in kernels:
        kernel = _kernel(linear, name)
        ms = _time_widths(kernel, rows)  # the kernel as it is: not invariant
        fastest = ms if fastest is None or sum(ms[:2]) < sum(fastest[:2]) else fastest
        probed = _kernel(designed_linear(linear, generator), name)
        for block in BLOCK_ROWS:
            if probe_blocks(probed, linear.in_features, linear.weight.dtype, block, generator):
                candidates.append(LinearChoice(name, block, _time_blocks(kernel, rows, block)))
            else:
                log.warning(
                    "linear %s: %s blocks of %d fail the probe", _shape_key(linear), name, block
                )
    if not candidates:  # one row per call: every row's call is the one it makes alone
        ones = LinearChoice("plain", 1, _time_blocks(_kernel(linear, "plain"), rows, 1))
        return LinearChoice(ones.kernel, 1, ones.ms, tuple(fastest)), False
    best = min(candidates, key=_score)
    return LinearChoice(best.kernel, best.block_rows, best.ms, tuple(fastest)), True


def designed_linear(linear: nn.Linear, generator: torch.Generator) -> nn.Linear:
    """A linear of `linear`'s shape, dtype and bias whose weights make the probe sharp:
    +-1 everywhere, the second half of every row of weights equal to its first half
    (so that a cancelling pair in an input row, at i and i + in/2, cancels exactly)."""
    out_features, in_features = linear.out_features, linear.in_features
    half = in_features // 2
    weight = _signs((out_features, in_features), generator)
    weight[:, half : 2 * half] = weight[:, :half]
    # made on "meta": no random init of a weight about to be replaced (seconds for an lm_head)
    designed = nn.Linear(in_features, out_features, bias=linear.bias is not None, device="meta")
    designed.weight = nn.Parameter(weight.to(linear.weight.dtype), requires_grad=False)
    if linear.bias is not None:
        designed.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    return designed.eval()


def designed_rows(count: int, in_features: int, dtype, generator) -> torch.Tensor:
    """[count, in] rows of +-1 with a cancelling pair +-2^26 at i and i + in/2 (i random
    per row): in fp32 the +-1 terms a kernel adds while one of the pair is in its sum are
    lost, so the output tells which terms it summed between them: any change of a row's
    summation order (grouping, lanes, K blocks) changes most of its outputs."""
    cancelling = min(CANCELLING, _largest_power_of_two(dtype))
    rows = _signs((count, in_features), generator) * (cancelling / CANCELLING)
    half = in_features // 2
    if half:
        where = torch.randint(0, half, (count,), generator=generator)
        rows[torch.arange(count), where] = cancelling
        rows[torch.arange(count), where + half] = -cancelling
    return rows.to(dtype)


def _largest_power_of_two(dtype: torch.dtype) -> float:
    """The largest power of two `dtype` holds: fp16's pair is 2^15, its terms 2^-11."""
    return 2.0 ** math.floor(math.log2(torch.finfo(dtype).max))


def probe_blocks(
    kernel: Callable, in_features: int, dtype: torch.dtype, block_rows: int, generator
) -> bool:
    """Whether `kernel` (over a designed_linear) gives each designed row, at every place
    of a block and beside other rows, the bits it gives the row alone, and the same bits
    twice. The second line behind the construction (module doc): PROBE_ROWS windows of
    consecutive rows, so that every place sees PROBE_ROWS rows, each compared."""
    rows = designed_rows(PROBE_ROWS + block_rows, in_features, dtype, generator)
    alone = torch.cat(
        [run_in_blocks(kernel, rows[i : i + 1], block_rows) for i in range(len(rows))]
    )
    if not torch.equal(alone[:1], run_in_blocks(kernel, rows[:1], block_rows)):
        return False  # not even deterministic
    for shift in range(PROBE_ROWS):
        together = run_in_blocks(kernel, rows[shift : shift + block_rows], block_rows)
        if not torch.equal(together, alone[shift : shift + block_rows]):
            return False
    return True


def _signs(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    return (torch.randint(0, 2, shape, generator=generator) * 2 - 1).float()


def _score(choice: LinearChoice) -> float:
    one, verify, chunk = choice.ms
    return one + verify + PREFILL_WEIGHT * chunk


def _time_blocks(kernel: Callable, rows: torch.Tensor, block: int) -> tuple[float, ...]:
    return _time_widths(lambda x: run_in_blocks(kernel, x, block), rows)


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
