"""How many tokens to draft in the next round.

A fixed k is the textbook setting. Speculation only pays when the expected number of
tokens per round outweighs what drafting and a longer verification cost, so the policy
sees every finished round and may change k (down to 0: plain target decoding).
"""

from __future__ import annotations

import abc

from speculative.stats import RoundStats


class SpeculationPolicy(abc.ABC):
    max_k: int  # the largest k this policy will ever ask for

    @abc.abstractmethod
    def next_k(self) -> int:
        """Draft tokens for the next round (0 = a plain target step)."""

    def observe(self, round_stats: RoundStats) -> None:
        """Learns from a finished round."""


class FixedK(SpeculationPolicy):
    def __init__(self, k: int):
        self.max_k = k

    def next_k(self) -> int:
        return self.max_k
