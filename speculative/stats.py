"""Statistics of a generation: what was drafted, what was accepted, where time went.

Kept out of the round logic: the loop hands each finished round to `record_round`.
Network time (`network_ns`) and transport time (`transport_ns`) are defined here once,
for the stats, the spans, the metrics and the report (docs/glossary.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from foundation.load import StepLoad
from speculative.types import NextTokenKind


@dataclass(frozen=True)
class LookupCheck:
    """In a cascade (prompt lookup before a draft model): what lookup proposed this round,
    or would have where the model proposed (a free check of its worth), and how much of
    it the target's tokens matched."""

    size: int  # the n-gram size lookup matched
    drafted: int  # its tokens
    accepted: int = 0  # its leading tokens the target's output then held
    proposed: bool = False  # lookup took the turn (else the model did)


@dataclass(frozen=True, kw_only=True)
class RoundStats:
    index: int  # 0-based round number within the request
    base_len: int  # committed length the proposal extended, in tokens
    num_drafted: int  # draft tokens proposed (0: a plain target step)
    num_accepted: int  # accepted prefix of them
    num_committed: int  # tokens this round added to the output (after stop cuts)
    next_token_kind: NextTokenKind
    draft_ns: int  # time to propose, in nanoseconds
    verify_ns: int  # time from sending the proposal to having the verdict, in nanoseconds
    target_compute_ns: (
        int  # the target's forward pass and decision, in nanoseconds (0: no pass ran)
    )
    # The target worker's whole time on the proposal (compute, its step's queue, host work), in ns; 0: not measured.
    target_handled_ns: int = 0
    # The target decoded this token alone, streamed (the adaptive policy found that
    # faster than drafting): no proposal, and verify_ns is the time since the last token.
    streamed: bool = False
    step: StepLoad | None = None  # the target's batched step (None: not reported)
    drafted_ahead: bool = False  # its proposal was drafted while the one before was verified
    late_ns: int = 0  # its verdict waited this long for the draft (busy drafting the next proposal)
    draft_warm: bool = (
        False  # the draft's first token came with its prefill: drafting cost a pass less
    )
    # A token tree's nodes off its first path (what a chain would have proposed), and the
    # accepted tokens they added past the first path's: 0 and 0 for a chain.
    branch_nodes: int = 0
    branch_tokens: int = 0
    # A cascade's prompt lookup guess this round decided (made this round or before); and
    # whether lookup proposed this round's tokens (they tell nothing of the model's a).
    lookup: LookupCheck | None = None
    lookup_turn: bool = False

    @property
    def network_ns(self) -> int:
        """The round trip less the target's pass (`network_ns`)."""
        return network_ns(self.verify_ns, self.target_compute_ns)

    @property
    def transport_ns(self) -> int:
        """The transport alone (`transport_ns`)."""
        return transport_ns(self.verify_ns, self.target_handled_ns, self.target_compute_ns)

    @property
    def target_host_ns(self) -> int:
        """The target's work on the proposal outside its pass and its step's queue (0: not reported)."""
        if not self.target_handled_ns:
            return 0
        queue_ns = self.step.queue_ns if self.step is not None else 0
        return max(0, self.target_handled_ns - self.target_compute_ns - queue_ns)


@dataclass
class GenerationStats:
    num_generated_tokens: int = 0
    num_rounds: int = 0  # target forward passes after prefill
    num_drafted: int = 0
    num_accepted: int = 0
    num_streamed: int = 0  # tokens the target decoded alone within speculating calls
    # [max k] rounds that drafted / accepted a token at draft position i
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    prefill_ns: int = 0  # target and draft prefill, in nanoseconds
    draft_ns: int = 0  # in nanoseconds
    verify_ns: int = 0  # round trips to the target, in nanoseconds
    target_compute_ns: int = 0  # the target's own compute within verify_ns, in nanoseconds
    total_ns: int = 0  # wall time of the whole request, in nanoseconds
    queue_ns: int = 0  # waited on the target before its steps began, in nanoseconds

    def record_round(self, round_stats: RoundStats) -> None:
        self.num_rounds += 1
        self.num_generated_tokens += round_stats.num_committed
        self.num_drafted += round_stats.num_drafted
        self.num_accepted += round_stats.num_accepted
        self.num_streamed += round_stats.streamed
        _grow(self.drafted_per_position, round_stats.num_drafted)
        _grow(self.accepted_per_position, round_stats.num_drafted)
        for position in range(round_stats.num_drafted):
            self.drafted_per_position[position] += 1
        for position in range(round_stats.num_accepted):
            self.accepted_per_position[position] += 1
        self.draft_ns += round_stats.draft_ns
        self.verify_ns += round_stats.verify_ns
        self.target_compute_ns += round_stats.target_compute_ns
        if round_stats.step is not None:
            self.queue_ns += round_stats.step.queue_ns

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_per_round(self) -> float:
        """Accepted draft tokens per round that drafted anything."""
        drafting_rounds = self.drafted_per_position[0] if self.drafted_per_position else 0
        return self.num_accepted / drafting_rounds if drafting_rounds else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Output tokens per target forward pass (1.0 = no gain from speculation)."""
        return self.num_generated_tokens / self.num_rounds if self.num_rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(draft token i accepted | it was drafted)."""
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_per_position, self.drafted_per_position)
        ]

    @property
    def network_ns(self) -> int:
        """Over the rounds (`network_ns`)."""
        return network_ns(self.verify_ns, self.target_compute_ns)

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / (self.total_ns / 1e9) if self.total_ns else 0.0

    def summary(self) -> str:
        """A few human-readable lines."""
        by_position = " ".join(f"{rate:.2f}" for rate in self.acceptance_by_position)
        ms = 1e-6
        return "\n".join(
            [
                f"tokens: {self.num_generated_tokens} in {self.total_ns * 1e-9:.2f} s "
                f"({self.tokens_per_second:.1f} tokens/s), {self.num_rounds} target passes "
                f"({self.tokens_per_round:.2f} tokens per pass)",
                f"drafted {self.num_drafted}, accepted {self.num_accepted} "
                f"(acceptance {self.acceptance_rate:.1%}, {self.mean_accepted_per_round:.2f} per "
                f"drafting round); by position: {by_position or '-'}"
                + (
                    f"; {self.num_streamed} tokens decoded by the target alone"
                    if self.num_streamed
                    else ""
                ),
                f"time: prefill {self.prefill_ns * ms:.0f} ms, draft {self.draft_ns * ms:.0f} ms, "
                f"verify {self.verify_ns * ms:.0f} ms (target compute "
                f"{self.target_compute_ns * ms:.0f} ms, network {self.network_ns * ms:.0f} ms)",
            ]
        )


def network_ns(verify_ns: int, target_compute_ns: int) -> int:
    """Network time: a round trip to the target less the target's pass (its forward pass
    and decision), in nanoseconds: transport and serialization, and the target's wait for
    its step and its host work around the pass. With the draft's own bookkeeping, a
    round's delay R (report/model.py)."""
    return max(0, verify_ns - target_compute_ns)


def transport_ns(verify_ns: int, target_handled_ns: int, target_compute_ns: int) -> int:
    """Transport time: a round trip to the target less the target's whole time on the
    proposal (its pass, its step's queue, its host work), in nanoseconds: the transport
    and serialization alone. Where the target did not report its whole time (0), the
    network time."""
    return max(0, verify_ns - (target_handled_ns or target_compute_ns))


def _grow(counts: list[int], size: int) -> None:
    counts.extend([0] * (size - len(counts)))
