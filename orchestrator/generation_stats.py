"""What one Generate call counts, and the GenerationStats message it ends with."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from orchestrator.workers import TARGET
from service_common.convert import generation_stats_to_proto
from service_common.telemetry import OutputTiming
from specdec.v1 import common_pb2
from speculative.stats import GenerationStats, RoundStats


@dataclass
class CallStats:
    """The core's round statistics, plus what only the orchestrator sees: the tokens the
    target prefilled for the call, the failovers, the call's wall time, when its tokens
    came (for its time per output token)."""

    totals: GenerationStats = field(default_factory=GenerationStats)
    num_prefill_tokens: int = 0  # tokens the target prefilled for this call
    num_failovers: int = 0
    start_ns: int = field(default_factory=time.perf_counter_ns)
    output: OutputTiming = field(default_factory=OutputTiming)  # on the perf_counter_ns clock

    @property
    def num_rounds(self) -> int:
        return self.totals.num_rounds

    def count_prefill(self, pool: str, prefill_ns: int, num_tokens: int) -> None:
        self.totals.prefill_ns += prefill_ns
        if pool == TARGET:
            self.num_prefill_tokens += num_tokens

    def count_round(self, round_stats: RoundStats) -> None:
        self.totals.record_round(round_stats)
        self.output.add(round_stats.num_committed, time.perf_counter_ns())

    def end(self) -> None:
        """Stops the clock; the time per output token goes to the metrics."""
        self.totals.total_ns = time.perf_counter_ns() - self.start_ns
        self.output.record()

    def to_proto(self) -> common_pb2.GenerationStats:
        s = self.totals
        orchestrator_ns = max(
            0, s.total_ns - s.prefill_ns - s.draft_ns - s.verify_ns
        )  # what no worker measured
        stats = generation_stats_to_proto(s, orchestrator_ns, self.num_prefill_tokens)
        stats.num_failovers = self.num_failovers
        return stats
