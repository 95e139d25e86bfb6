"""One sequence on one model: its tokens and its KV cache, with absolute rollback.

The session knows more tokens than its cache holds: tokens appended but not yet run
through the model are "pending". Logits are computed lazily, for the pending tokens, in
one forward pass. This makes the draft-lag case free: when every draft token is
accepted the draft never ran its own last token, which simply stays pending and runs
with the bonus token in the next pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from speculative.errors import InvalidArgument


class ModelSession:
    """Token ids and KV cache of one sequence. Not thread-safe: one owner at a time."""

    def __init__(self, model: PreTrainedModel, context_length: int):
        self._model = model
        self._context_length = context_length  # tokens; the model's positional limit
        self._cache = DynamicCache(config=model.config)
        self._token_ids: list[int] = []
        self._cached_len = 0  # tokens whose keys and values are in the cache
        self.num_forward_passes = 0
        self.num_forward_tokens = 0  # tokens run through the model, prefill included

    @property
    def length(self) -> int:
        """Committed plus pending tokens: the length the next proposal extends."""
        return len(self._token_ids)

    @property
    def cached_length(self) -> int:
        return self._cached_len

    @property
    def last_token_id(self) -> int:
        return self._token_ids[-1]

    @property
    def token_ids(self) -> list[int]:
        return list(self._token_ids)

    def append(self, token_ids: Sequence[int]) -> None:
        """Adds tokens without running the model (they become pending)."""
        if self.length + len(token_ids) > self._context_length:
            raise InvalidArgument(
                f"sequence of {self.length + len(token_ids)} tokens exceeds the model's "
                f"context length of {self._context_length} tokens"
            )
        self._token_ids.extend(int(t) for t in token_ids)

    def prefill(self) -> None:
        """Runs all tokens but the last, which stays pending for the first logits call."""
        if self.length - 1 > self._cached_len:
            self._forward(self._token_ids[self._cached_len : -1], num_logits=1)

    def logits(self, num_positions: int) -> torch.Tensor:
        """Logits for the last `num_positions` tokens: [num_positions, vocab_size].

        Runs every pending token through the model in one pass. If fewer tokens are
        pending (e.g. right after a rollback), cached ones are re-run.
        """
        assert 1 <= num_positions <= self.length, (num_positions, self.length)
        self._crop_cache(min(self._cached_len, self.length - num_positions))
        return self._forward(self._token_ids[self._cached_len :], num_logits=num_positions)

    def truncate_to(self, length: int) -> None:
        """Rolls back to the first `length` tokens (absolute, so a repeat is harmless)."""
        if not 0 <= length <= self.length:
            raise InvalidArgument(f"cannot truncate a {self.length}-token session to {length}")
        del self._token_ids[length:]
        self._crop_cache(min(self._cached_len, length))

    def release(self) -> None:
        """Frees the KV cache; the session keeps its tokens and can be re-prefilled."""
        self._cache = DynamicCache(config=self._model.config)
        self._cached_len = 0

    def _crop_cache(self, length: int) -> None:
        if length < self._cached_len:
            # transformers 5.x: crop takes the negative number of tokens to remove.
            self._cache.crop(length - self._cached_len)
            self._cached_len = length

    @torch.inference_mode()
    def _forward(self, token_ids: list[int], num_logits: int) -> torch.Tensor:
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self._model.device)
        output = self._model(
            input_ids=input_ids,
            cache=self._cache,
            use_cache=True,
            logits_to_keep=num_logits,
        )
        self._cached_len += len(token_ids)
        self.num_forward_passes += 1
        self.num_forward_tokens += len(token_ids)
        return output.logits[0, -num_logits:]
