"""Sampling parameters and the logits processing shared by draft and target.

Temperature 0 is an explicit greedy path (argmax of the raw logits), never a tiny
temperature. Randomness is explicit: one `torch.Generator` per request, always on the
CPU, so a seed reproduces a run on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculative.types import SamplingParams

__all__ = [
    "SamplingParams",
    "SparseProbs",
    "greedy_tokens",
    "logits_to_probs",
    "make_generator",
    "sample_from",
]


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request (CPU so a seed gives the same draws on any device)."""
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p, then softmax, in fp32.

    logits: [num_positions, vocab_size]. Returns probs of the same shape, each row summing
    to 1, exactly zero outside the kept set. Not for greedy requests.
    """
    assert not params.greedy, "greedy requests take the argmax path"
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _keep_top_p(probs, params.top_p)
    return probs


def _keep_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero out tokens outside the nucleus and renormalise. probs: [n, vocab_size]."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    # A token is kept while the mass strictly before it is below top_p: the most
    # likely token is therefore always kept.
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Argmax per position (first index on ties). logits: [n, vocab_size]."""
    return logits.argmax(dim=-1).tolist()


def sample_from(probs: torch.Tensor, uniform: float) -> int:
    """Inverse-CDF sample of one token. probs: [vocab_size]; uniform in [0, 1).

    One uniform per sample, drawn by the caller in a fixed order, so runs reproduce.
    """
    cdf = torch.cumsum(probs.double(), dim=-1)
    index = int(torch.searchsorted(cdf, uniform * cdf[-1], right=True))
    # Guards against uniform * total landing on the final edge through rounding; the
    # last token with nonzero probability is the right answer there.
    if index >= probs.shape[-1]:
        index = int(torch.nonzero(probs).max())
    return index


@dataclass(frozen=True)
class SparseProbs:
    """A distribution that is zero outside a few tokens: what a draft sampled from.

    Because the draft truncates before it samples, this sparse distribution is the exact
    one the token came from, so the rejection rule stays exact.
    """

    token_ids: torch.Tensor  # [m] int64, distinct
    probs: torch.Tensor  # [m] float32, sums to 1

    @staticmethod
    def truncate(probs: torch.Tensor, max_support: int) -> SparseProbs:
        """Keep the `max_support` most likely tokens of probs [vocab_size], renormalised."""
        nonzero = int((probs > 0).sum())
        values, ids = torch.topk(probs.float(), min(max_support, nonzero))
        return SparseProbs(token_ids=ids.cpu(), probs=(values / values.sum()).cpu())

    @staticmethod
    def one_hot(token_id: int) -> SparseProbs:
        return SparseProbs(torch.tensor([token_id]), torch.tensor([1.0]))

    def sample(self, uniform: float) -> int:
        return int(self.token_ids[sample_from(self.probs, uniform)])

    def prob_of(self, token_id: int) -> float:
        match = (self.token_ids == token_id).nonzero()
        return float(self.probs[match[0, 0]]) if len(match) else 0.0

    def to_dense(self, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        dense = torch.zeros(vocab_size, dtype=torch.float32)
        dense[self.token_ids] = self.probs
        return dense.to(device)
