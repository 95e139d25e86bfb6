"""What a worker's load looked like to a piece of work: the step that ran it."""

from __future__ import annotations

from dataclasses import dataclass

from foundation.pass_cost import PassCost


@dataclass(frozen=True)
class StepLoad:
    """The target's batched step that ran a piece of work, as the work saw it (times in
    nanoseconds)."""

    queue_ns: int  # waited before its step(s) began: behind other steps, for admission
    step_ns: int  # wall clock of the step: the whole batch's pass and decisions
    batch_tokens: int  # tokens in the step, over every session in it
    batch_sessions: int  # sessions in the step
    waiting_sessions: int  # sessions with work on the worker when the step began
    # The worker's step cost over its recent steps (`cost`), as on the wire: a step of
    # T tokens that need logits takes about cost_base_ns + T * cost_per_token_ns, in
    # nanoseconds (0 and 0: not measured yet).
    cost_base_ns: float = 0.0
    cost_per_token_ns: float = 0.0

    @property
    def cost(self) -> PassCost:
        """The worker's step cost (its prefill tokens' price stays on the worker)."""
        return PassCost(self.cost_base_ns, self.cost_per_token_ns)
