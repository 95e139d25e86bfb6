"""From spans to the numbers of the report.

Target-only decoding time per token (t_target), in order of preference:
1. given (`--target-step-ms`), e.g. measured by a benchmark;
2. measured in the same trace file: the mean `specdec.decode` span, i.e. one token of a
   target-only run through the services (k = 0: the orchestrator uses Decode);
3. estimated: the fitted verification time of width 0 (a one-token target pass), which
   leaves out the target's per-token bookkeeping; the report says so.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from foundation.pass_cost import PassCost
from report.model import K_MAX, CostModel, alpha_from_rounds, fit_verify
from report.traces import DecodeStep, Round, Span, decode_steps_of, rounds_of

GIVEN, MEASURED, ESTIMATED = "given", "measured", "estimated"


@dataclass(frozen=True)
class RunPoint:
    """One trace (one request) with speculation: a measured point for the plots."""

    trace_id: str
    k: int  # the calls' k (largest of the trace)
    delay_ns: float  # mean per-round delay R (network + other)
    ns_per_token: float
    speedup: float  # against t_target


@dataclass
class Report:
    num_spans: int
    services: list[str]
    rounds: list[Round]
    decode_steps: list[DecodeStep]
    target_step_ns: float | None
    target_step_source: str | None
    model: CostModel | None
    verify_by_k: dict[int, tuple[float, int]]  # k -> (mean target compute ns, rounds)
    points: list[RunPoint] = field(default_factory=list)
    events: list[str] = field(
        default_factory=list
    )  # the orchestrator's failovers and rollbacks, in words

    # --- acceptance ---------------------------------------------------------------------

    @property
    def drafting_rounds(self) -> list[Round]:
        return [r for r in self.rounds if r.k > 0]

    @property
    def num_drafted(self) -> int:
        return sum(r.k for r in self.rounds)

    @property
    def num_accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def num_generated(self) -> int:
        return sum(r.committed for r in self.rounds)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted draft tokens per drafting round."""
        drafting = self.drafting_rounds
        return sum(r.accepted for r in drafting) / len(drafting) if drafting else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.num_generated / len(self.rounds) if self.rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[tuple[int, int]]:
        """[position] (accepted, drafted): rounds that drafted / accepted position i."""
        k_max = max((r.k for r in self.rounds), default=0)
        return [
            (sum(1 for r in self.rounds if r.accepted > i), sum(1 for r in self.rounds if r.k > i))
            for i in range(k_max)
        ]

    # --- time ---------------------------------------------------------------------------

    def mean_split_ns(self) -> dict[str, float]:
        """Mean time per round: draft, target compute, the target's host work, transport
        (the round trip less the target's whole time; where the target does not report
        it, the network time), other; and the total."""
        n = len(self.rounds)
        if not n:
            return {}
        return {
            "draft": sum(r.draft_ns for r in self.rounds) / n,
            "target compute": sum(r.target_compute_ns for r in self.rounds) / n,
            "target host": sum(r.target_host_ns for r in self.rounds) / n,
            "transport": sum(r.transport_ns for r in self.rounds) / n,
            "other": sum(r.other_ns for r in self.rounds) / n,
            "total": sum(r.duration_ns for r in self.rounds) / n,
        }

    @property
    def ns_per_token(self) -> float:
        """Speculative decoding's round time per output token: round time / tokens (the
        first token's round included: not the TPOT metric, docs/glossary.md)."""
        return (
            sum(r.duration_ns for r in self.rounds) / self.num_generated
            if self.num_generated
            else 0.0
        )

    @property
    def measured_speedup(self) -> float | None:
        if not self.target_step_ns or not self.ns_per_token:
            return None
        return self.target_step_ns / self.ns_per_token

    @property
    def typical_k(self) -> int:
        """The calls' k most traces used."""
        if not self.points:
            return max((r.max_k for r in self.rounds), default=0)
        return Counter(p.k for p in self.points).most_common(1)[0][0]

    @property
    def mean_delay_ns(self) -> float:
        """Measured R: network time + other per round of the calls that speculated."""
        rounds = [r for r in self.rounds if r.max_k > 0] or self.rounds
        return sum(r.delay_ns for r in rounds) / len(rounds) if rounds else 0.0


def analyse(spans: Sequence[Span], target_step_ns: float | None = None) -> Report:
    rounds = rounds_of(spans)
    steps = decode_steps_of(spans)
    verify_by_k = _verify_by_k(rounds)
    source = GIVEN if target_step_ns else None
    if not target_step_ns and steps:
        target_step_ns, source = sum(s.duration_ns for s in steps) / len(steps), MEASURED
    model = None
    if rounds:
        verify = _fit(verify_by_k, steps)
        if not target_step_ns:
            target_step_ns, source = verify.base_ns, ESTIMATED
        drafting = [r for r in rounds if r.k > 0]
        drafted = sum(r.k for r in drafting)
        speculating = [r for r in rounds if r.max_k > 0]  # rounds of calls that asked for drafts
        model = CostModel(
            alpha=alpha_from_rounds([(r.k, r.accepted) for r in rounds]),
            target_step_ns=target_step_ns,
            draft_step_ns=sum(r.draft_ns for r in drafting) / drafted if drafted else 0.0,
            verify=verify,
            draft_fraction=len(drafting) / len(speculating) if speculating else 1.0,
        )
    report = Report(
        num_spans=len(spans),
        services=sorted({s.service for s in spans if s.service}),
        rounds=rounds,
        decode_steps=steps,
        target_step_ns=target_step_ns,
        target_step_source=source,
        model=model,
        verify_by_k=verify_by_k,
        events=_orchestrator_events(spans),
    )
    report.points = _points(rounds, target_step_ns)
    return report


def _orchestrator_events(spans: Sequence[Span]) -> list[str]:
    """Failovers (`specdec.failover`, attribute specdec.lost) and rollbacks that cut
    generated tokens at a stop string (`specdec.rollback`, attribute specdec.cut_tokens)."""
    failovers = [s for s in spans if s.name == "specdec.failover"]
    rollbacks = [s for s in spans if s.name == "specdec.rollback"]
    events = []
    if failovers:
        lost = Counter(w for s in failovers for w in s.attributes.get("specdec.lost", ()))
        events.append(
            f"failovers: {len(failovers)}"
            + (f" (lost: {', '.join(f'{w} x{n}' for w, n in lost.items())})" if lost else "")
        )
    if rollbacks:
        cuts = [int(s.attributes.get("specdec.cut_tokens", 0)) for s in rollbacks]
        events.append(
            f"rollbacks: {len(rollbacks)}, {sum(c > 0 for c in cuts)} of them cut generated tokens "
            f"at a stop string ({sum(cuts)} tokens)"
        )
    return events


def _verify_by_k(rounds: Sequence[Round]) -> dict[int, tuple[float, int]]:
    by_k: dict[int, list[int]] = defaultdict(list)
    for r in rounds:
        by_k[r.k].append(r.target_compute_ns)
    return {k: (sum(v) / len(v), len(v)) for k, v in sorted(by_k.items())}


def _fit(verify_by_k: dict[int, tuple[float, int]], steps: Sequence[DecodeStep]) -> PassCost:
    """t_verify(k) from the verifications measured per width; Decode steps are
    verifications of width 0 (one target pass, same code path on the target)."""
    points = [(k, ns, n) for k, (ns, n) in verify_by_k.items()]
    if steps and 0 not in verify_by_k:
        points.append((0, sum(s.target_compute_ns for s in steps) / len(steps), len(steps)))
    return fit_verify(points)


def _points(rounds: Sequence[Round], target_step_ns: float | None) -> list[RunPoint]:
    by_trace: dict[str, list[Round]] = defaultdict(list)
    for r in rounds:
        by_trace[r.trace_id].append(r)
    points = []
    for trace_id, trace_rounds in by_trace.items():
        tokens = sum(r.committed for r in trace_rounds)
        if not tokens:
            continue
        ns_per_token = sum(r.duration_ns for r in trace_rounds) / tokens
        points.append(
            RunPoint(
                trace_id,
                max(r.max_k for r in trace_rounds),
                sum(r.delay_ns for r in trace_rounds) / len(trace_rounds),
                ns_per_token,
                target_step_ns / ns_per_token if target_step_ns else 0.0,
            )
        )
    return points


# --- text ---------------------------------------------------------------------------------


def _ms(ns: float) -> str:
    return f"{ns * 1e-6:.2f} ms"


def render(report: Report, k_max: int = K_MAX) -> str:
    lines = [
        f"spans: {report.num_spans} from {', '.join(report.services) or 'no services'}; "
        f"{len(report.points)} traces with speculation rounds, "
        f"{len({s.trace_id for s in report.decode_steps})} with target-only decoding",
    ]
    lines += report.events
    if not report.rounds:
        lines.append("no specdec.round spans: nothing to report (was the draft worker traced?)")
        return "\n".join(lines)
    drafting = report.drafting_rounds
    lines += [
        f"rounds: {len(report.rounds)} ({len(drafting)} drafting), generated {report.num_generated} tokens, "
        f"drafted {report.num_drafted}, accepted {report.num_accepted}",
        f"acceptance rate: {report.acceptance_rate:.1%} of drafted tokens",
        f"mean accepted length: {report.mean_accepted_length:.2f} tokens per drafting round "
        f"({report.tokens_per_round:.2f} tokens per round with the target's own)",
        "acceptance by position: "
        + " ".join(
            f"{i + 1}:{a / d:.0%}({d})"
            for i, (a, d) in enumerate(report.acceptance_by_position)
            if d
        ),
    ]
    split = report.mean_split_ns()
    total = split["total"]
    lines.append(
        "time per round (mean): "
        + ", ".join(
            f"{name} {_ms(ns)} ({ns / total:.0%})" for name, ns in split.items() if name != "total"
        )
        + f"; total {_ms(total)}"
    )
    lines.append(
        "verification (target compute) by width: "
        + ", ".join(f"k={k}: {_ms(ns)} ({n})" for k, (ns, n) in report.verify_by_k.items())
    )
    source_note = {
        GIVEN: "given",
        MEASURED: f"measured: {len(report.decode_steps)} Decode steps in this trace",
        ESTIMATED: "estimated: fitted one-token verification, no target-only run in the trace",
    }[report.target_step_source]
    lines.append(f"target-only decoding: {_ms(report.target_step_ns)} per token ({source_note})")
    speedup = report.measured_speedup
    lines.append(
        f"speculative decoding: {_ms(report.ns_per_token)} of rounds per output token -> measured speedup "
        f"{speedup:.2f}x against target-only"
        if speedup
        else "measured speedup: n/a"
    )
    lines += _model_lines(report, k_max)
    return "\n".join(lines)


def _model_lines(report: Report, k_max: int) -> list[str]:
    model = report.model
    k, delay = report.typical_k, report.mean_delay_ns
    lines = [
        "model (Leviathan et al. 2023, E[tokens] = (1 - alpha^(k+1)) / (1 - alpha), with a per-round delay R):",
        f"  alpha {model.alpha:.3f} per token, t_target {_ms(model.target_step_ns)}, "
        f"t_draft {_ms(model.draft_step_ns)} per token, t_verify(k) = {_ms(model.verify.base_ns)} + "
        f"{_ms(model.verify.per_token_ns)} * k, measured R {_ms(delay)} per round",
    ]
    if model.draft_fraction < 1.0:
        lines.append(
            f"  drafting rounds f = {model.draft_fraction:.1%}: the drafter proposed nothing in the other "
            "rounds (one-token target steps that still pay R)"
        )
    if k > 0:
        break_even = model.break_even_delay_ns(k)
        lines.append(
            f"  at k={k}: predicted speedup {model.speedup(k, delay):.2f}x; "
            f"break-even round-trip delay R = {_ms(break_even)}"
            + (
                f" (speculation stops paying at {_ms((break_even - delay) / 2)} added one-way delay)"
                if break_even > delay
                else " (already past it: speculation does not pay here)"
            )
        )
    for label, at in (("the measured R", delay), ("R = 0", 0.0)):
        best = model.best_k(at, k_max)
        value = model.speedup(best, at)
        verdict = (
            f"k={best} ({value:.2f}x)"
            if value > 1
            else f"none: k=0 (best k={best} reaches only {value:.2f}x)"
        )
        lines.append(
            f"  best k at {label}: {verdict}, break-even R there {_ms(model.break_even_delay_ns(best))}"
        )
    return lines
