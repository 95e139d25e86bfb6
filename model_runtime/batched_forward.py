"""One forward pass over the new tokens of many sequences: ragged rows, own KV caches.

Layout (the "why" of docs/architecture.md, Batching):
- The new tokens of every sequence in a step are concatenated into ONE row,
  `[1, total_tokens]`, with each token's own absolute position. The linears, which
  are nearly all of a forward pass's cost on a CPU and most of it on a GPU at small
  batch, run once over all of them with no padding.
- Each sequence keeps its keys and values in its own contiguous tensors per layer
  (`SequenceKV`), grown by chunks. Attention runs per sequence, its queries against
  views of its own cache: no gather of every sequence's cache into one padded tensor
  per step (what a slot-copy or an sdpa-over-paged design pays in memory traffic),
  and rollback is setting a length, never copying.
- The per-sequence attention loop is the price: a few small kernels per sequence per
  layer, cheap next to the linears at the batch sizes one worker runs.
- On a CPU, a step wider than EXACT_ROWS rows is padded to a few widths (`padded_rows`,
  at most 1/8 more rows): oneDNN builds and keeps kernels and caches per row count,
  and steps of every width a prompt's chunk can give would grow a worker's memory by
  megabytes per new width for as long as new widths turn up (measured on
  SmolLM2-135M: +0.5-0.6 GiB over widths 1..200, +0.12 GiB padded). Padding rows
  attend to nothing and give no logits; every real row's result is its own.

The attention function is registered with transformers (`AttentionInterface`) under
RAGGED_ATTENTION and installed on the model (`use_ragged_attention`); called without a
ragged batch (e.g. by `generate`), it is plain sdpa, so the model stays usable as
before. Works for every decoder whose attention layers call the attention interface
with post-rotary keys (Llama, Qwen2, Mistral, ...), on any device, with device_map.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from model_runtime.row_invariance import invariance_of, row_attention
from model_runtime.static_passes import passes_of, static_attention

RAGGED_ATTENTION = "specdec_ragged"
EXACT_ROWS = 64  # steps up to this wide run as they are: decode steps and proposals
KV_GROWTH_TOKENS = 256  # a cache grows by at least this many tokens: few reallocations
WIDTHS_ATTR = (
    "specdec_width_plan"  # on a model: its calibrated small-step widths (width_padding.py)
)
LOCKSTEP_ATTR = (
    "specdec_lockstep"  # on rank 0 of a tensor-parallel model: what announces its passes
)
# Mask creation sees this 4D "mask" and passes it through untouched; the ragged
# attention builds each sequence's causal mask itself.
_NO_MASK = torch.empty(1, 1, 0, 0, dtype=torch.bool)


class SequenceKV:
    """Keys and values of one sequence, per layer: `[num_kv_heads, capacity, head_dim]`
    tensors on the layer's device. The owner tracks how many positions are valid;
    truncation is the owner lowering that number."""

    def __init__(self):
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        # Edits other ranks' copies must replay (a tensor-parallel model: tensor_parallel.py); None: none kept.
        self.edits: list[tuple] | None = None

    def write(
        self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores `[num_kv_heads, t, head_dim]` keys and values at positions
        start..start+t; returns views of positions 0..start+t."""
        end = start + keys.shape[1]
        cached_keys = self._room(self._keys, layer, keys, end)
        cached_values = self._room(self._values, layer, values, end)
        cached_keys[:, start:end] = keys
        cached_values[:, start:end] = values
        return cached_keys[:, :end], cached_values[:, :end]

    def _room(
        self, store: dict[int, torch.Tensor], layer: int, like: torch.Tensor, end: int
    ) -> torch.Tensor:
        current = store.get(layer)
        if current is not None and current.shape[1] >= end:
            return current
        capacity = max(end, (current.shape[1] * 2 if current is not None else 0), KV_GROWTH_TOKENS)
        grown = like.new_empty(like.shape[0], capacity, like.shape[2])
        if current is not None:
            grown[:, : current.shape[1]] = current
        store[layer] = grown
        return grown

    @torch.inference_mode()  # the caches are inference tensors (written in forward_segments)
    def move(self, sources: Sequence[int], start: int) -> None:
        """Copies the keys and values at positions `sources` to start, start + 1, ...
        in every layer (a tree's accepted path, into place)."""
        if self.edits is not None:
            self.edits.append(("move", list(sources), start))
        for store in (self._keys, self._values):
            for tensor in store.values():
                index = torch.tensor(sources, device=tensor.device)
                tensor[:, start : start + len(sources)] = tensor[:, index]  # the index copies first

    def clear(self) -> None:
        if self.edits is not None:
            self.edits.append(("clear",))
        self._keys.clear()
        self._values.clear()

    def capacity(self) -> int:
        """Positions allocated (in the first layer), in tokens."""
        return next(iter(self._keys.values())).shape[1] if self._keys else 0


class SlotKV(SequenceKV):
    """A SequenceKV whose tensors are a slot of a KVPool (static_passes.py), taken at the
    first write and given back when cleared; past the pool's capacity, or with every
    slot taken, it keeps tensors of its own as SequenceKV does (and runs eager)."""

    def __init__(self, pool):
        super().__init__()
        self.pool = pool
        self.slot: int | None = None
        self._own = False  # growing its own tensors: never a slot again until cleared

    def _room(self, store, layer, like, end):
        if not self._own and self.slot is None:
            self.slot = self.pool.take()
            self._own = self.slot is None
        if not self._own and end > self.pool.capacity:
            self._leave_slot()
        if self._own:
            return super()._room(store, layer, like, end)
        if layer not in store:
            store[layer] = (self.pool.keys if store is self._keys else self.pool.values)[layer][
                self.slot
            ]
        return store[layer]

    def _leave_slot(self) -> None:
        """Copies what the slot holds into tensors of its own (a sequence past the capacity)."""
        for store in (self._keys, self._values):
            for layer, view in store.items():
                store[layer] = view.clone()
        self.pool.give_back(self.slot)
        self.slot, self._own = None, True

    def clear(self) -> None:
        super().clear()
        if self.slot is not None:
            self.pool.give_back(self.slot)
        self.slot, self._own = None, False


def new_sequence_kv(model: PreTrainedModel) -> SequenceKV:
    """A sequence's cache: in the model's KV pool where it has one (static_passes.py)."""
    passes = passes_of(model)
    return passes.pool.new_kv() if passes is not None else SequenceKV()


@dataclass
class Segment:
    """One sequence's part of a batched step: its new tokens, where they start, and
    how many of the last positions need logits."""

    kv: SequenceKV
    start: int  # position of the first new token = tokens already cached
    token_ids: list[int]  # [t] the new tokens
    num_logits: int  # logits for the last num_logits new tokens; 0 = none (prefill)
    fill: bool = False  # a prefill chunk: runs after the segments that wait for logits, cut to fit
    # Logits already computed (the last prompt token's, by its prefill): no pass runs it.
    ready_logits: torch.Tensor | None = None
    # A tree of new tokens: each one's parent among them (-1: the cached token before
    # them), each stored at its own position but seen only by its descendants and placed
    # at its depth. None: a chain (token j after token j - 1).
    parents: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_run_tokens(self) -> int:
        """Tokens a pass runs for this segment: none when its logits are ready."""
        return 0 if self.ready_logits is not None else len(self.token_ids)

    def positions(self) -> torch.Tensor:
        """Each new token's position: its index after `start`, or in a tree its depth."""
        if self.parents is None:
            return torch.arange(self.start, self.start + self.num_tokens)
        depths: list[int] = []
        for parent in self.parents:
            depths.append(0 if parent < 0 else depths[parent] + 1)
        return torch.tensor(depths) + self.start

    def trim(self, num_tokens: int) -> None:
        """Keeps the first `num_tokens` new tokens (a prefill chunk; in place, so the
        session that handed the segment out sees what ran). A cut chunk no longer ends
        with the token whose logits it was to give."""
        assert (self.fill or self.num_logits == 0) and 1 <= num_tokens, (
            self.num_logits,
            num_tokens,
        )
        if num_tokens < self.num_tokens:
            del self.token_ids[num_tokens:]
            self.num_logits = 0


@dataclass
class _RaggedBatch:
    segments: Sequence[Segment]
    offsets: list[int]  # [num_segments + 1] row offsets of each segment's tokens
    masks: list[torch.Tensor | None]  # [num_segments] causal masks [t, start + t]
    row_invariant: bool = False  # each row attends alone (model_runtime/row_invariance.py)


def use_ragged_attention(model: PreTrainedModel) -> None:
    """Installs the ragged attention on a loaded model (idempotent)."""
    AttentionInterface.register(RAGGED_ATTENTION, _ragged_attention)
    AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)
    if model.config._attn_implementation != RAGGED_ATTENTION:
        model.set_attn_implementation(RAGGED_ATTENTION)


@torch.inference_mode()
def forward_segments(model: PreTrainedModel, segments: Sequence[Segment]) -> list[torch.Tensor]:
    """Runs every segment's new tokens in one forward pass, writing their keys and
    values into each segment's cache; returns each segment's logits,
    `[num_logits, vocab_size]` (empty for num_logits 0). A segment whose logits are
    ready is not run: its logits are returned as they are."""
    to_run = [segment for segment in segments if segment.ready_logits is None]
    computed = iter(_forward(model, to_run) if to_run else [])
    return [
        segment.ready_logits if segment.ready_logits is not None else next(computed)
        for segment in segments
    ]


def _forward(model: PreTrainedModel, segments: Sequence[Segment]) -> list[torch.Tensor]:
    if model.config._attn_implementation != RAGGED_ATTENTION:
        use_ragged_attention(model)
    passes = passes_of(model)
    if passes is not None and passes.accepts(segments):
        logits = passes.run(segments)  # a fixed-shape pass (a CUDA graph on a GPU)
        if logits is not None:
            return logits
    if passes is not None:
        passes.num_eager += 1
    device = model.device
    offsets = [0]
    for segment in segments:
        offsets.append(offsets[-1] + segment.num_tokens)
    padding = (
        padded_rows(offsets[-1], getattr(model, WIDTHS_ATTR, None)) - offsets[-1]
        if device.type == "cpu"
        else 0
    )
    token_ids = [t for s in segments for t in s.token_ids] + [0] * padding
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    positions = torch.cat(
        [s.positions() for s in segments] + [torch.zeros(padding, dtype=torch.long)]
    ).to(device)
    keep = [
        offsets[i + 1] - s.num_logits + j
        for i, s in enumerate(segments)
        for j in range(s.num_logits)
    ]
    masks = [
        _causal_mask(s.start, s.num_tokens, device)
        if s.parents is None
        else _tree_mask(s.start, s.parents, device)
        for s in segments
    ]
    lockstep = getattr(
        model, LOCKSTEP_ATTR, None
    )  # rank 0 of a tensor-parallel model (tensor_parallel.py)
    with lockstep.announced(segments) if lockstep is not None else contextlib.nullcontext():
        output = model(
            input_ids=input_ids,
            position_ids=positions.unsqueeze(0),
            attention_mask=_NO_MASK.to(device),
            use_cache=False,
            logits_to_keep=torch.tensor(keep or [0], device=device),
            ragged_batch=_RaggedBatch(segments, offsets, masks, invariance_of(model) is not None),
        )
    logits = output.logits[0]  # [len(keep), vocab_size]
    results, row = [], 0
    for segment in segments:
        results.append(logits[row : row + segment.num_logits])
        row += segment.num_logits
    return results


def padded_rows(rows: int, widths=None) -> int:
    """The width a CPU step of `rows` rows runs at: up to EXACT_ROWS, rows or the cheaper
    width a calibrated `widths` (width_padding.WidthPlan) picks; above, the next
    multiple of an eighth of the power of two below it (65..128 rows by 8, 129..256
    by 16, ...): at most 1/8 more rows, 8 widths per doubling."""
    if rows <= EXACT_ROWS:
        return widths.width(rows) if widths is not None else rows
    grain = 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // grain) * grain


def _causal_mask(start: int, num_tokens: int, device: torch.device) -> torch.Tensor | None:
    """[t, start + t] booleans: new token j sees positions 0..start + j. None for one
    token, which sees everything."""
    if num_tokens == 1:
        return None
    keys = torch.arange(start + num_tokens, device=device)
    queries = torch.arange(start, start + num_tokens, device=device)
    return keys[None, :] <= queries[:, None]


def _tree_mask(start: int, parents: list[int], device: torch.device) -> torch.Tensor:
    """[t, start + t] booleans: new token j sees the cached positions, its ancestors
    among the new tokens and itself."""
    sees = torch.eye(len(parents), dtype=torch.bool)
    for j, parent in enumerate(parents):
        if parent >= 0:
            sees[j] |= sees[parent]
    return torch.cat([torch.ones(len(parents), start, dtype=torch.bool), sees], dim=1).to(device)


def _ragged_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    ragged_batch: _RaggedBatch | None = None,
    static_batch=None,
    **kwargs,
):
    """query `[1, num_heads, T, head_dim]`, key and value `[1, num_kv_heads, T, head_dim]`
    for the step's new tokens -> `[1, T, num_heads, head_dim]`, as sdpa_attention_forward."""
    if static_batch is not None:  # a fixed-shape pass (static_passes.py)
        return static_attention(module, query, key, value, static_batch, scaling)
    if ragged_batch is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    output = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
    gqa = query.shape[1] != key.shape[1]
    offsets = ragged_batch.offsets
    for i, segment in enumerate(ragged_batch.segments):
        a, b = offsets[i], offsets[i + 1]
        keys, values = segment.kv.write(
            module.layer_idx, segment.start, key[0, :, a:b], value[0, :, a:b]
        )
        if ragged_batch.row_invariant:
            output[0, a:b] = row_attention(
                query[:, :, a:b], keys, values, segment.start, segment.parents, scaling
            )
            continue
        mask = ragged_batch.masks[i]
        if mask is not None and mask.device != query.device:  # a layer on another GPU (device_map)
            mask = mask.to(query.device)
        attended = F.scaled_dot_product_attention(
            query[:, :, a:b],
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            scale=scaling,
            enable_gqa=gqa,
        )  # [1, num_heads, t, head_dim]
        output[0, a:b] = attended[0].transpose(0, 1)
    output[0, offsets[-1] :] = 0  # padding rows (padded_rows): nothing to attend to
    return output, None
