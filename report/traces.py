"""Spans from the services' JSON-lines files (service_common.telemetry.span_to_dict),
and the rounds and target-only steps in them."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from speculative.stats import network_ns, transport_ns

ROUND_SPAN = "specdec.round"  # draft worker, one per speculation round
DECODE_SPAN = "specdec.decode"  # target worker, one per target-only Decode token
VERIFY_SPAN = "specdec.verify"  # target worker, one per proposal
PREFILL_SPAN = "specdec.prefill"  # both workers, one per prompt or extension read


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str | None  # None: the root of its trace
    start_ns: int  # Unix time, nanoseconds
    end_ns: int
    attributes: dict
    service: str  # resource service.name: orchestrator, draft, target
    instance: str = ""  # resource service.instance.id: which worker ("": not recorded)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def read_spans(paths: Iterable[str | Path]) -> list[Span]:
    """Every span of the files (one JSON object a line; blank lines skipped)."""
    spans = []
    for path in paths:
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                resource = record.get("resource") or {}
                spans.append(
                    Span(
                        record["name"],
                        record["trace_id"],
                        record["span_id"],
                        record.get("parent_span_id"),
                        int(record["start_ns"]),
                        int(record["end_ns"]),
                        record.get("attributes") or {},
                        resource.get("service.name", ""),
                        resource.get("service.instance.id", ""),
                    )
                )
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number}: not a span record ({error})") from None
    return spans


@dataclass(frozen=True)
class Round:
    """One speculation round as the draft worker traced it; times in nanoseconds."""

    trace_id: str
    k: int  # draft tokens proposed
    accepted: int
    committed: int  # tokens output (accepted + 1, less a cut at a stop token)
    duration_ns: int  # the whole round on the draft worker
    draft_ns: int
    verify_ns: int  # round trip to the target
    target_compute_ns: int
    max_k: int  # the call's k (a round may draft fewer: an n-gram without a match drafts none)
    target_handled_ns: int = 0  # the target's whole time on the proposal (0: not reported)
    target_host_ns: int = 0  # of it, host work outside the pass and the step's queue

    @property
    def network_ns(self) -> int:
        """The round trip less the target's pass (docs/glossary.md, network time)."""
        return network_ns(self.verify_ns, self.target_compute_ns)

    @property
    def transport_ns(self) -> int:
        """The transport alone (docs/glossary.md, transport time)."""
        return transport_ns(self.verify_ns, self.target_handled_ns, self.target_compute_ns)

    @property
    def other_ns(self) -> int:
        """Choosing k, applying the verdict to the draft, bookkeeping."""
        return max(0, self.duration_ns - self.draft_ns - self.verify_ns)

    @property
    def delay_ns(self) -> int:
        """What the cost model calls R: the round's time besides drafting and the target's
        pass (the network time and the draft's bookkeeping)."""
        return self.network_ns + self.other_ns


@dataclass(frozen=True)
class DecodeStep:
    """One token of target-only decoding (the target's Decode stream)."""

    trace_id: str
    duration_ns: int
    target_compute_ns: int


def rounds_of(spans: Sequence[Span]) -> list[Round]:
    rounds = []
    for span in spans:
        if span.name != ROUND_SPAN:
            continue
        a = span.attributes
        rounds.append(
            Round(
                span.trace_id,
                int(a["specdec.k"]),
                int(a["specdec.accepted"]),
                int(a["specdec.committed"]),
                span.duration_ns,
                int(a["specdec.draft_ns"]),
                int(a["specdec.verify_ns"]),
                int(a["specdec.target_compute_ns"]),
                int(a.get("specdec.max_k", a["specdec.k"])),
                int(a.get("specdec.target_handled_ns", 0)),
                int(a.get("specdec.target_host_ns", 0)),
            )
        )
    return rounds


def decode_steps_of(spans: Sequence[Span]) -> list[DecodeStep]:
    return [
        DecodeStep(
            s.trace_id,
            s.duration_ns,
            int(s.attributes.get("specdec.target_compute_ns", s.duration_ns)),
        )
        for s in spans
        if s.name == DECODE_SPAN
    ]
