"""GPU-shaped pass costs for a named target/draft pair, where no GPU measured them.

A pass is memory-bound until it is compute-bound (the roofline):

    pass(R rows, T tokens) = max((weights + R x context x KV a token) / HBM bandwidth,
                                 T x 2 x params / peak FLOPs)

weights = params x 2 bytes (bf16); context = prompt + half the new tokens (a session's
mean). Both at the datasheet's figures, so a bound no real pass beats: the compiled,
CUDA-graph path of DESIGN.md ("a pass costs what its weights cost to stream"); an eager
pass is launch-bound and slower (benchmarks/results/gpu.md measured ~6x the bound on an
H200). Tensor parallelism over g GPUs is counted ideal (g x bandwidth, g x FLOPs).
Activations, the output layer's logits and host work are left out.

The one pair a GPU run measured (benchmarks/results/gpu.md: qwen2.5-7b verifying,
qwen2.5-1.5b drafting, random weights of the real shapes, bf16, eager, on an H200) is
here with its measured numbers, which the planner prefers to a bound where they apply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner.costs import Costs, DraftStep, TargetPass

BYTES_PER_PARAM = 2  # bf16
DRAFT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Accelerator:
    """A GPU as its vendor's datasheet states it (assumptions, not measurements)."""

    name: str
    hbm_bytes_per_s: float  # memory bandwidth, bytes a second
    bf16_flops_per_s: float  # dense (no sparsity), FLOPs a second
    memory_bytes: float
    source: str


H100 = Accelerator(
    "H100 SXM",
    3.35e12,
    989e12,
    80e9,
    "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 3.35 TB/s HBM3, 989 TFLOPS bf16 dense "
    "(1,979 with sparsity), 80 GB",
)
H200 = Accelerator(
    "H200 SXM",
    4.8e12,
    989e12,
    141e9,
    "NVIDIA H200 Tensor Core GPU datasheet (SXM): 4.8 TB/s HBM3e, 989 TFLOPS bf16 dense, 141 GB",
)
L4 = Accelerator(
    "L4",
    300e9,
    121e12,
    24e9,
    "NVIDIA L4 Tensor Core GPU datasheet: 300 GB/s GDDR6, 121 TFLOPS bf16 dense "
    "(242 with sparsity), 24 GB",
)


@dataclass(frozen=True)
class ModelShape:
    """What a pass reads and computes: parameters and the KV cache's shape."""

    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def weight_bytes(self) -> float:
        return self.params * BYTES_PER_PARAM

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of every layer, bf16."""
        return 2 * self.layers * self.kv_heads * self.head_dim * BYTES_PER_PARAM

    @property
    def flops_per_token(self) -> float:
        return 2 * self.params


# The models' published configurations (config.json on their model cards).
LLAMA_3_1_8B = ModelShape("Llama-3.1-8B", 8.03e9, 32, 8, 128)
LLAMA_3_1_70B = ModelShape("Llama-3.1-70B", 70.6e9, 80, 8, 128)
LLAMA_3_2_1B = ModelShape("Llama-3.2-1B", 1.24e9, 16, 8, 64)


@dataclass(frozen=True)
class Pair:
    target: ModelShape
    target_gpu: Accelerator
    draft: ModelShape
    draft_gpu: Accelerator
    target_gpus: int = 1  # tensor parallel over this many (ideal scaling)

    @property
    def draft_hardware(self) -> str:
        return f"{self.draft_gpu.name} ({self.draft.name})"


PAIRS = {
    "llama-8b-h100+llama-1b-l4": Pair(LLAMA_3_1_8B, H100, LLAMA_3_2_1B, L4),
    "llama-8b-h100+llama-1b-h100": Pair(LLAMA_3_1_8B, H100, LLAMA_3_2_1B, H100),
    # deploy/k8s/overlays/gpu: 70B over a node's 4 GPUs, a 1B draft on one GPU each.
    "llama-70b-4xh100+llama-1b-l4": Pair(LLAMA_3_1_70B, H100, LLAMA_3_2_1B, L4, target_gpus=4),
}
MEASURED = "qwen-7b-h200+qwen-1.5b-h200-measured"


def roofline_ms(
    model: ModelShape, gpu: Accelerator, rows: int, tokens: int, context: int, gpus: int = 1
) -> float:
    """A pass of `tokens` over `rows` sessions of `context` cached tokens each, in ms."""
    memory_s = (model.weight_bytes + rows * context * model.kv_bytes_per_token) / (
        gpus * gpu.hbm_bytes_per_s
    )
    compute_s = tokens * model.flops_per_token / (gpus * gpu.bf16_flops_per_s)
    return 1000.0 * max(memory_s, compute_s)


def pair_costs(name: str, prompt_tokens: int, new_tokens: int) -> tuple[TargetPass, DraftStep]:
    """The pair's target pass and draft step at a request's mean context."""
    if name == MEASURED:
        return measured_h200_qwen()
    if name not in PAIRS:
        raise ValueError(f"no GPU pair {name!r}: choose among {sorted([*PAIRS, MEASURED])}")
    pair = PAIRS[name]
    context = prompt_tokens + new_tokens // 2
    t, tg, g = pair.target, pair.target_gpu, pair.target_gpus
    bandwidth, flops = g * tg.hbm_bytes_per_s, g * tg.bf16_flops_per_s
    target = TargetPass(
        base_ms=1000.0 * t.weight_bytes / bandwidth,
        per_token_ms=0.0,
        per_row_ms=1000.0 * context * t.kv_bytes_per_token / bandwidth,
        prefill_token_ms=0.0,
        compute_per_token_ms=1000.0 * t.flops_per_token / flops,
        source=f"roofline bound: {t.name} bf16 on {g} x {tg.source}; context {context} tokens",
    )

    def draft_table(gpu: Accelerator) -> tuple[tuple[int, float], ...]:
        return tuple((b, roofline_ms(pair.draft, gpu, b, b, context)) for b in DRAFT_BATCHES)

    draft = DraftStep(
        ms_by_batch=draft_table(pair.draft_gpu),
        prefill_token_ms=1000.0 * pair.draft.flops_per_token / pair.draft_gpu.bf16_flops_per_s,
        colocated_ms_by_batch=draft_table(tg),
        source=(
            f"roofline bound: {pair.draft.name} bf16 on {pair.draft_gpu.source} "
            f"(co-located: on the target's {tg.name}); context {context} tokens"
        ),
    )
    return target, draft


def measured_h200_qwen() -> tuple[TargetPass, DraftStep]:
    """benchmarks/results/gpu.md (H200, bf16, eager, random weights of the real shapes):
    the 7B's pass 19.42 / 19.54 / 19.07 / 18.91 / 19.25 ms at widths 1 / 2 / 4 / 8 / 16
    (flat: launch-bound), the 1.5B's width-1 pass 17.50 ms. Not measured: how a pass
    grows with sessions batched, or a draft step with its batch (taken as flat, as the
    widths were), nor a draft on a GPU of its own (taken as the same GPU)."""
    source = "benchmarks/results/gpu.md, H200 bf16 eager (batch growth not measured: flat)"
    target = TargetPass(base_ms=19.24, per_token_ms=0.0, source=source)
    draft = DraftStep(ms_by_batch=((1, 17.50),), source=source)
    return target, draft


def with_gpu_costs(costs: Costs, name: str) -> Costs:
    """The costs file with its target and draft replaced by the GPU pair's (the session
    cap and token budget kept from the file)."""
    target, draft = pair_costs(name, costs.request.prompt_tokens, costs.request.new_tokens)
    target = dataclasses.replace(
        target,
        max_sessions=costs.target.max_sessions,
        max_batch_tokens=costs.target.max_batch_tokens,
    )
    return dataclasses.replace(costs, target=target, draft=draft)


def draft_hardware(name: str | None) -> str:
    """What one draft worker runs on, in words."""
    if name is None:
        return "draft worker"
    if name == MEASURED:
        return "H200 (qwen2.5-1.5b)"
    return PAIRS[name].draft_hardware
