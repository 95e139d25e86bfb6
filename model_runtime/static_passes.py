"""Passes of fixed shapes over KV memory allocated up front: replayed as CUDA graphs on a
GPU, where an eager pass costs its kernel launches, not its weights.

Measured on an H200 (benchmarks/results/gpu.md): an eager pass of a 7B-shaped model
took 19.4 ms for 1 new token and 19.3 ms for 16, a 1.5B-shaped one 17.5 ms; the 7B's
weights stream from HBM in about 3.5 ms. The host launching a few hundred small
kernels per pass is the cost, so the pass must be one graph launch (gpt-fast's way:
a static KV cache indexed by position, `torch.compile(mode="reduce-overhead")`).

- **KV memory up front** (`KVPool`): per layer, keys and values `[num_slots + 1,
  num_kv_heads, capacity + 1, head_dim]`. A session's cache (`SlotKV`, a SequenceKV)
  takes a slot at its first write and gives it back when freed; its tensors are views
  of the slot, so the eager ragged path (batched_forward) runs on them unchanged, and
  rollback stays a length. Slot `num_slots` and position `capacity` are scratch: the
  padding of a pass writes there. A session longer than `capacity`, or one that found
  every slot taken, keeps its own growing tensors (SequenceKV's) and runs eager.
- **A pass of fixed shape** (`StaticPasses.run`): `sessions x rows`, each rounded up to
  a bucket (1, 2, 4, 8, 16), every row's keys and values written at its position in its
  slot, attention over the whole slot with a mask built on the device from the
  positions, the logits of every row; the segments' own rows taken out after. Taken
  for steps of chains (no trees) of at most 16 rows a session and 16 sessions whose
  caches all hold slots; any other step runs eager.
- **Replayed as CUDA graphs** on a GPU (`CudaGraphs`): one graph per bucket, captured
  at its first use (two eager warm-up runs and a capture: milliseconds, not a
  compiler's minutes), inputs copied into its static buffers, one launch a pass. On a
  CPU the same step can be compiled by inductor (`torch.compile`, tests). A capture or
  compile that fails is logged and the step runs eager from then on.

Not with row invariance (its per-row attention is not a fixed shape) nor with tensor
parallelism (the ranks run eager): the worker refuses the combination at start.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16)  # sessions a pass, and rows a session, rounded up to these
STATIC_ATTR = "specdec_static_passes"  # on a model: its StaticPasses
ON, OFF, AUTO = "on", "off", "auto"
MODES = (AUTO, ON, OFF)


class KVPool:
    """Every layer's keys and values for `num_slots` sessions of up to `capacity` tokens."""

    def __init__(self, model: PreTrainedModel, num_slots: int, capacity: int):
        config = model.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        parameter = next(model.parameters())
        shape = (num_slots + 1, kv_heads, capacity + 1, head_dim)
        self.keys = [parameter.new_zeros(shape) for _ in range(config.num_hidden_layers)]
        self.values = [parameter.new_zeros(shape) for _ in range(config.num_hidden_layers)]
        for tensor in (*self.keys, *self.values):
            torch._dynamo.mark_static_address(tensor)  # a CUDA graph writes into them in place
        self.num_slots, self.capacity = num_slots, capacity
        self.scratch_slot = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    def new_kv(self):
        from model_runtime.batched_forward import SlotKV

        return SlotKV(self)


@dataclass
class StaticBatch:
    """What the attention layers of a fixed-shape pass read (model_runtime.batched_forward)."""

    pool: KVPool
    slots: torch.Tensor  # [sessions] long: each row-group's slot
    positions: torch.Tensor  # [sessions, rows] long: each new token's position
    mask: torch.Tensor  # [sessions, 1, rows, capacity + 1] bool: key position <= the row's


def static_attention(module, query, key, value, batch: StaticBatch, scaling):
    """query `[sessions, heads, rows, head_dim]`, key and value `[sessions, kv_heads,
    rows, head_dim]` -> `[sessions, rows, heads, head_dim]`, the new keys and values
    written into the slots first."""
    layer = module.layer_idx
    keys, values = batch.pool.keys[layer], batch.pool.values[layer]
    index = (
        batch.slots[:, None],
        slice(None),
        batch.positions,
    )  # -> [sessions, rows, kv_heads, head_dim]
    keys[index] = key.transpose(1, 2)
    values[index] = value.transpose(1, 2)
    attended = torch.nn.functional.scaled_dot_product_attention(
        query,
        keys.index_select(0, batch.slots),
        values.index_select(0, batch.slots),
        attn_mask=batch.mask,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return attended.transpose(1, 2), None


def bucket(count: int) -> int | None:
    return next((size for size in BUCKETS if size >= count), None)


class CudaGraphs:
    """`step(ids, positions, slots)` replayed as one CUDA graph per input shape."""

    def __init__(self, step):
        self.step = step
        self.graphs: dict[tuple, tuple] = {}  # shape -> (graph, static inputs, static output)
        self.memory = torch.cuda.graph_pool_handle()  # one pool: the graphs replay one at a time

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        key = tuple(tuple(t.shape) for t in inputs)
        if key not in self.graphs:
            self.graphs[key] = self._capture(inputs)
        graph, buffers, output = self.graphs[key]
        for buffer, value in zip(buffers, inputs):
            buffer.copy_(value, non_blocking=True)
        graph.replay()
        return output

    def _capture(self, inputs) -> tuple:
        buffers = [t.clone() for t in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # warm-up: libraries' handles and workspaces exist before capture
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step(*buffers)  # writes the same keys and values the pass will
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory):
            output = self.step(*buffers)
        return graph, buffers, output


class StaticPasses:
    """The fixed-shape passes of one model over its KVPool: replayed as CUDA graphs
    ("cuda-graphs"), compiled by inductor ("inductor") or eager (None)."""

    def __init__(self, model: PreTrainedModel, pool: KVPool, compile_mode: str | None):
        self.model, self.pool = model, pool
        device = pool.keys[0].device
        self._positions = torch.arange(pool.capacity + 1, device=device)
        from model_runtime.batched_forward import _NO_MASK

        self._no_mask = _NO_MASK.to(
            device
        )  # made before any capture: a copy from the host cannot be captured
        self._step = self._eager_step
        self.compile_mode = compile_mode
        self.failure: str | None = None  # why compiled passes were given up, if they were
        if compile_mode == "cuda-graphs":
            self._step = CudaGraphs(self._eager_step)
        elif compile_mode == "inductor":  # one compiled graph per bucket
            torch._dynamo.config.cache_size_limit = max(
                torch._dynamo.config.cache_size_limit, len(BUCKETS) ** 2
            )
            self._step = torch.compile(self._eager_step, dynamic=False)
        elif compile_mode is not None:
            raise ValueError(
                f"compile_mode must be cuda-graphs, inductor or None, got {compile_mode!r}"
            )
        self.num_static = self.num_eager = 0  # passes run each way
        # Greedy draft chains run back to back on the device (greedy_chain): where each
        # pass is one graph launch, a read back per token would idle the GPU between them.
        self.device_loop = compile_mode == "cuda-graphs"

    def accepts(self, segments) -> bool:
        from model_runtime.batched_forward import SlotKV

        return len(segments) <= BUCKETS[-1] and all(
            s.parents is None
            and isinstance(s.kv, SlotKV)
            and s.kv.slot is not None
            and 1 <= s.num_tokens <= BUCKETS[-1]
            and s.start + s.num_tokens <= self.pool.capacity
            for s in segments
        )

    def run(self, segments) -> list[torch.Tensor] | None:
        """Each segment's logits `[num_logits, vocab]` from one fixed-shape pass; None
        where the compiled pass failed (the caller runs it eager; logged once)."""
        sessions, rows = bucket(len(segments)), bucket(max(s.num_tokens for s in segments))
        device = self.pool.keys[0].device
        ids = torch.zeros(sessions, rows, dtype=torch.long)
        positions = torch.full((sessions, rows), self.pool.capacity, dtype=torch.long)
        slots = torch.full((sessions,), self.pool.scratch_slot, dtype=torch.long)
        for i, segment in enumerate(segments):
            t = segment.num_tokens
            ids[i, :t] = torch.tensor(segment.token_ids)
            positions[i, :t] = torch.arange(segment.start, segment.start + t)
            slots[i] = segment.kv.slot
        logits = self._call(ids.to(device), positions.to(device), slots.to(device))
        if logits is None:
            return None
        self.num_static += 1
        # Copies: a graph's output is overwritten by its next replay.
        return [
            logits[i, s.num_tokens - s.num_logits : s.num_tokens].clone()
            for i, s in enumerate(segments)
        ]

    def greedy_chain(self, kv, start: int, token_ids: list[int], k: int) -> list[int] | None:
        """k greedy tokens after `token_ids` (new, from position `start`): k passes back
        to back, each fed the last one's argmax on the device, one read back at the end.
        The keys and values of the first k - 1 drafted tokens are written; the last
        token's are not (it runs with the next pass, if accepted). None where they do not
        fit the fixed shapes (no slot, too long)."""
        t = len(token_ids)
        if (
            getattr(kv, "slot", None) is None
            or t > BUCKETS[-1]
            or start + t + k > self.pool.capacity
        ):
            return None
        device = self.pool.keys[0].device
        ids = torch.zeros(1, bucket(t), dtype=torch.long)
        positions = torch.full((1, bucket(t)), self.pool.capacity, dtype=torch.long)
        ids[0, :t] = torch.tensor(token_ids)
        positions[0, :t] = torch.arange(start, start + t)
        slot = torch.tensor([kv.slot], device=device)
        logits = self._call(ids.to(device), positions.to(device), slot)
        if logits is None:
            return None
        drafted = [logits[0, t - 1].argmax(-1).view(1, 1)]
        position = torch.empty(1, 1, dtype=torch.long, device=device)
        for index in range(1, k):
            position.fill_(start + t + index - 1)
            if (logits := self._call(drafted[-1], position, slot)) is None:
                return None  # nothing committed: the caller drafts again, eager
            drafted.append(logits[0, 0].argmax(-1).view(1, 1))
        self.num_static += k
        return torch.cat(drafted).flatten().tolist()  # the one read back

    def _call(self, *inputs: torch.Tensor) -> torch.Tensor | None:
        """The step on `inputs`; None where a compiled step (a capture, a compile) failed:
        logged, and every later step runs eager. The keys and values it may have written
        are past every cache's length, rewritten by the eager pass."""
        try:
            return self._step(*inputs)
        except Exception as error:  # noqa: BLE001 - a compiler's or a capture's failure, kept in the report
            if self._step == self._eager_step:
                raise
            first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
            self.failure = f"{type(error).__name__}: {first}"
            log.warning("compiled passes failed, running them eager from now on: %s", self.failure)
            self._step, self.device_loop = self._eager_step, False
            return None

    def _eager_step(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        mask = self._positions[None, None, None, :] <= positions[:, None, :, None]
        output = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=self._no_mask,
            use_cache=False,
            static_batch=StaticBatch(self.pool, slots, positions, mask),
        )
        return output.logits  # [sessions, rows, vocab]


def install(
    model: PreTrainedModel, mode: str, num_slots: int, capacity: int
) -> StaticPasses | None:
    """Gives `model` a KV pool and fixed-shape passes as `mode` says (auto: compiled as
    CUDA graphs on a GPU; off on a CPU, where the eager ragged path measured faster:
    docs/batching.md); returns them, or None when off."""
    if mode not in MODES:
        from foundation.errors import InvalidArgument

        raise InvalidArgument(f"static passes must be one of {', '.join(MODES)}, got {mode!r}")
    device = next(model.parameters()).device
    if mode == OFF or (mode == AUTO and device.type != "cuda"):
        return None
    passes = StaticPasses(
        model, KVPool(model, num_slots, capacity), "cuda-graphs" if device.type == "cuda" else None
    )
    setattr(model, STATIC_ATTR, passes)
    log.info(
        "static passes: %d slots of %d tokens, %s",
        num_slots,
        capacity,
        "CUDA graphs" if device.type == "cuda" else "eager",
    )
    return passes


def passes_of(model: PreTrainedModel) -> StaticPasses | None:
    return getattr(model, STATIC_ATTR, None)
