"""One sequence on one model: its tokens and its KV cache, with absolute rollback.

The session knows more tokens than its cache holds: tokens appended but not yet run
through the model are "pending". Logits are computed lazily, for the pending tokens, in
one forward pass. This makes the draft-lag case free: when every draft token is
accepted the draft never ran its own last token, which simply stays pending and runs
with the bonus token in the next pass.

The prefill's last chunk runs the last token too and keeps its logits (every pass
computes the logits of at least one row anyway), while the token stays pending: the
first call for the logits of that one token then needs no pass, as in `generate`,
whose prefill gives the first token.

A pass is a `Segment` (model_runtime.batched_forward): the session hands out what it
needs run (`pending_segment`, `prefill_segment`) and is told when it ran
(`segment_done`), so that a scheduler can run the segments of many sessions in one
batched pass; `logits` and `prefill` run the session's own segment alone.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator, Sequence
from typing import TypeVar

import torch
from transformers import PreTrainedModel

from foundation.errors import InvalidArgument
from foundation.sequence import TokenSequence
from model_runtime.batched_forward import Segment, forward_segments, new_sequence_kv

T = TypeVar("T")

# Work on a session that needs forward passes: a generator that yields the segments to
# run, one at a time, is sent each one's logits `[num_logits, vocab_size]` and the
# pass's time in nanoseconds as (logits, forward_ns), and returns its result.
ForwardSteps = Generator[Segment, "tuple[torch.Tensor, int]", T]


class Emit:
    """Yielded by a streaming job (StepScheduler.stream) between its segments: a value
    its caller gets as soon as the step that produced it ends, while the job stays in
    the steps (a stretch's tokens: no turn-around between them)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class ModelSession:
    """Token ids and KV cache of one sequence. Not thread-safe: one owner at a time."""

    def __init__(self, model: PreTrainedModel, context_length: int):
        self._model = model
        self._context_length = context_length  # tokens; the model's positional limit
        self._kv = new_sequence_kv(model)  # in the model's KV pool where it has one
        self._tokens = TokenSequence()
        self._cached_len = 0  # tokens whose keys and values are in the cache
        self._ready: torch.Tensor | None = (
            None  # [1, vocab] logits of the pending last token, from its prefill
        )
        self.num_forward_passes = 0
        self.num_forward_tokens = 0  # tokens run through the model, prefill included

    @property
    def model(self) -> PreTrainedModel:
        return self._model

    @property
    def length(self) -> int:
        """Committed plus pending tokens: the length the next proposal extends."""
        return len(self._tokens)

    @property
    def cached_length(self) -> int:
        return self._cached_len

    @property
    def last_token_id(self) -> int:
        return self._tokens.last_token_id

    @property
    def token_ids(self) -> list[int]:
        return list(self._tokens.ids)

    def append(self, token_ids: Sequence[int]) -> None:
        """Adds tokens without running the model (they become pending)."""
        if self.length + len(token_ids) > self._context_length:
            raise InvalidArgument(
                f"sequence of {self.length + len(token_ids)} tokens exceeds the model's "
                f"context length of {self._context_length} tokens"
            )
        self._tokens.append(token_ids)

    def prefill(self) -> None:
        """Caches all tokens but the last, which stays pending; the same pass gives its
        logits, kept for the first logits call."""
        run_alone(self._model, self.prefill_steps())

    def prefill_steps(self) -> ForwardSteps[None]:
        """`prefill` as forward passes for a scheduler (which may cut it into chunks)."""
        while (segment := self.prefill_segment()) is not None:
            logits, _ = yield segment
            self.segment_done(segment)
            # the last chunk ran the last token: its logits serve the next call
            if segment.num_logits:
                self._ready = logits.clone()  # not a view pinning the whole step's logits

    def logits(self, num_positions: int) -> torch.Tensor:
        """Logits for the last `num_positions` tokens: [num_positions, vocab_size].

        Runs every pending token through the model in one pass. If fewer tokens are
        pending (e.g. right after a rollback), cached ones are re-run.
        """
        return self._run_alone(self.pending_segment(num_positions))

    def pending_segment(self, num_positions: int) -> Segment:
        """The pass that gives logits for the last `num_positions` tokens: every
        pending token (cached ones re-run if fewer are pending)."""
        assert 1 <= num_positions <= self.length, (num_positions, self.length)
        ready = self._ready if num_positions == 1 and self._cached_len == self.length - 1 else None
        self._ready = (
            None  # kept for the next pass only: any other rewrites its token's keys and values
        )
        self._crop_cache(min(self._cached_len, self.length - num_positions))
        return Segment(
            self._kv,
            self._cached_len,
            self._tokens.ids[self._cached_len :],
            num_positions,
            ready_logits=ready,
        )

    def greedy_chain(self, k: int, chain) -> list[int] | None:
        """k greedy tokens appended by `chain(kv, start, pending token ids, k)` (a
        StaticPasses.greedy_chain: k passes on the device, one read back), the first k - 1
        cached and the last pending, as k single passes leave them; None where the
        pending tokens' logits are already kept (the first call after a prefill: no pass)
        or `chain` declines."""
        if self._ready is not None and self._cached_len == self.length - 1:
            return None
        segment = self.pending_segment(1)
        drafted = chain(self._kv, segment.start, segment.token_ids, k)
        if drafted is None:  # it did not fit: nothing ran, nothing changed
            return None
        self.segment_done(segment)
        self._tokens.append(drafted)
        self._cached_len += k - 1
        self.num_forward_passes += k - 1
        self.num_forward_tokens += k - 1
        return drafted

    def tree_segment(self, token_ids: Sequence[int], parents: Sequence[int]) -> Segment:
        """The pass that scores a tree of new tokens after the sequence (parents as in
        speculative.token_tree, -1 for the last token): every pending token, then the
        tree's; logits for the last pending token and each of the tree's. The tree's
        tokens are not appended: `tree_done` appends the path kept."""
        self._ready = None
        self._crop_cache(min(self._cached_len, self.length - 1))
        pending = self._tokens.ids[self._cached_len :]
        chain = list(range(-1, len(pending) - 1))
        tree = [len(pending) - 1 if parent < 0 else len(pending) + parent for parent in parents]
        return Segment(
            self._kv,
            self._cached_len,
            [*pending, *token_ids],
            len(token_ids) + 1,
            parents=chain + tree,
        )

    def tree_done(self, segment: Segment, path: Sequence[int]) -> None:
        """Records that a `tree_segment` ran, keeping the tree's nodes on `path` (root-most
        first): their keys and values move into place after the pending tokens, now
        cached, and their tokens are appended (pending none)."""
        self.segment_done(segment)
        # the tree's first node
        first = segment.start + segment.num_tokens - (segment.num_logits - 1)
        sources = [first + node for node in path]
        if sources != list(range(first, first + len(path))):
            self._kv.move(sources, first)
        self._cached_len = first + len(path)
        self._tokens.append([segment.token_ids[source - segment.start] for source in sources])

    def prefill_segment(self) -> Segment | None:
        """The pass that caches every token but the last and gives the last one's
        logits (kept for the next call), or None when they are cached. A scheduler may
        run fewer of its tokens (`Segment.trim`): the session then hands out the rest
        next time."""
        if self.length - 1 <= self._cached_len:
            return None
        self._ready = None
        return Segment(
            self._kv, self._cached_len, self._tokens.ids[self._cached_len :], 1, fill=True
        )

    def segment_done(self, segment: Segment) -> None:
        """Records that `segment` (from this session, as last handed out) ran. The last
        token of a prefill stays pending: its keys and values are written past the
        cached length, where nothing reads them until its logits are used."""
        assert segment.start == self._cached_len, (segment.start, self._cached_len)
        self._cached_len += segment.num_tokens - (segment.num_logits if segment.fill else 0)
        if segment.ready_logits is None:
            self.num_forward_passes += 1
            self.num_forward_tokens += segment.num_tokens

    def truncate_to(self, length: int) -> None:
        """Rolls back to the first `length` tokens (absolute, so a repeat is harmless)."""
        self._tokens.truncate_to(length)
        if length <= self._cached_len:  # the pending token whose logits are kept is gone
            self._ready = None
        self._crop_cache(min(self._cached_len, length))

    def release(self) -> None:
        """Frees the KV cache; the session keeps its tokens and can be re-prefilled."""
        self._kv.clear()
        self._cached_len = 0
        self._ready = None

    def _crop_cache(self, length: int) -> None:
        # Positions past the cached length are never read: a crop is a new length.
        self._cached_len = min(self._cached_len, length)

    def _run_alone(self, segment: Segment) -> torch.Tensor:
        logits = forward_segments(self._model, [segment])[0]
        self.segment_done(segment)
        return logits


def stream_alone(model: PreTrainedModel, steps: ForwardSteps[None]) -> Iterator:
    """Drives a streaming job (one that yields Emit between its segments) one unbatched
    forward pass at a time; yields what it emits."""
    item = next(steps, None)
    while item is not None:
        if isinstance(item, Emit):
            yield item.value
            item = next(steps, None)
            continue
        start = time.perf_counter_ns()
        logits = forward_segments(model, [item])[0]
        try:
            item = steps.send((logits, time.perf_counter_ns() - start))
        except StopIteration:
            return


def run_alone(model: PreTrainedModel, steps: ForwardSteps[T]) -> T:
    """Drives `steps` one unbatched forward pass at a time; returns their result."""
    try:
        segment = next(steps)
        while True:
            start = time.perf_counter_ns()
            logits = forward_segments(model, [segment])[0]
            segment = steps.send((logits, time.perf_counter_ns() - start))
    except StopIteration as done:
        return done.value
