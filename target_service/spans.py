"""The target worker's spans (service_common.telemetry; no-ops when telemetry is off):
`specdec.prefill` in OpenSession and Extend, `specdec.verify` per proposal (a child of
the Verify server span), `specdec.decode` per pass the target decodes alone (a Decode
stream, or a stretch on a Verify stream)."""

from __future__ import annotations

from opentelemetry import trace

from service_common import telemetry
from specdec.v1 import common_pb2, target_pb2
from target_service.engine import Pass

tracer = trace.get_tracer(__name__)


def prefill(session_id: str, base_len: int, num_tokens: int):
    """A specdec.prefill span around new input entering a target session."""
    return tracer.start_as_current_span(
        telemetry.PREFILL_SPAN,
        attributes={
            "specdec.session_id": session_id,
            "specdec.base_len": base_len,
            "specdec.tokens": num_tokens,
        },
    )


def verified(span, proposal: target_pb2.Proposal, verdict: target_pb2.Verdict) -> None:
    """Attributes of a specdec.verify span: the proposal and what the target decided."""
    if not span.is_recording():
        return
    discarded = verdict.WhichOneof("kind") == "discarded"
    decision = verdict.decision
    span.set_attributes(
        {
            "specdec.session_id": proposal.session_id,
            "specdec.round": proposal.round,
            "specdec.base_len": proposal.base_len,
            "specdec.k": len(proposal.draft.token_ids),
            "specdec.discarded": discarded,
            "specdec.accepted": decision.num_accepted,
            "specdec.committed": 0
            if discarded
            else max(0, decision.committed_len - proposal.base_len),
            "specdec.target_compute_ns": decision.target_compute_ns,
            **_step_attributes(decision.step),
        }
    )


def decode(
    session_id: str, one: Pass, step: common_pb2.StepLoad, round_index: int | None = None
) -> None:
    """A specdec.decode span for one pass of decoding (a token alone, or verifying prompt
    lookup's tokens too), from the pass before it (the run's start for the first)."""
    span = tracer.start_span(telemetry.DECODE_SPAN, start_time=one.start_ns)
    if span.is_recording():
        result = one.decoded.result
        attributes = {
            "specdec.session_id": session_id,
            "specdec.base_len": result.committed_len - len(result.token_ids),
            "specdec.target_compute_ns": result.target_compute_ns,
            **_step_attributes(step),
        }
        # a pass that verified prompt lookup's tokens (Stretch.lookup_rounds)
        if result.num_drafted:
            attributes.update(
                {"specdec.k": result.num_drafted, "specdec.accepted": result.verdict.num_accepted}
            )
        if round_index is not None:
            attributes["specdec.round"] = round_index
        span.set_attributes(attributes)
    span.end(end_time=one.decoded.emitted_ns)


def _step_attributes(step: common_pb2.StepLoad) -> dict:
    """Span attributes of the step that ran a call's work."""
    return {
        "specdec.queue_ns": step.queue_ns,
        "specdec.step_ns": step.step_ns,
        "specdec.batch_tokens": step.batch_tokens,
        "specdec.batch_sessions": step.batch_sessions,
    }
