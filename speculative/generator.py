"""An in-process generator on the speculation loop (speculative.speculation_loop):
target and drafter in one process, the target a local `TargetSession` (`LocalVerifier`).
The draft service runs the same loop against a remote target.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from foundation.errors import StaleProposal
from foundation.limits import validate_num_speculative_tokens
from model_runtime.fingerprint import check_compatible
from model_runtime.loading import LoadedModel
from model_runtime.width_padding import step_costs
from speculative.drafter_base import Drafter, DraftSession
from speculative.estimator import MeasuredCosts
from speculative.policy import AdaptiveK, FixedK, SpeculationPolicy
from speculative.prompt_lookup import LookupRounds, LookupStop
from speculative.sampling import SamplingParams
from speculative.speculation_loop import Features, speculation_rounds
from speculative.stats import GenerationStats
from speculative.target import TargetSession, VerifyResult
from speculative.token_tree import TokenTree
from speculative.types import FinishReason


class LocalVerifier:
    """A TargetSession as the loop's verifier in process: each proposal is verified when its verdict is received,
    with the target's own staleness rule. overlaps and runs_lookup are off by default (nothing computes while the
    loop drafts; lookup's rounds cost no round trip here); tests turn them on to run those protocols in process."""

    def __init__(self, target: TargetSession, overlaps: bool = False, runs_lookup: bool = False):
        self.target, self.overlaps, self.runs_lookup = target, overlaps, runs_lookup
        # [base_len, ids, probs, last, abandoned]
        self._outstanding: collections.deque[list] = collections.deque()

    def send(
        self, base_len, draft_token_ids, draft_probs, expected_last_token_id=None, parents=None
    ) -> None:
        tree = None if parents is None else TokenTree(tuple(draft_token_ids), tuple(parents))
        self._outstanding.append(
            [base_len, tree or list(draft_token_ids), draft_probs, expected_last_token_id, False]
        )

    def verdict_came(self) -> bool:
        return False  # a proposal is verified only when its verdict is received

    def abandon_last(self) -> None:
        self._outstanding[-1][4] = True

    def receive(self) -> VerifyResult:
        self._skip_abandoned()
        base_len, token_ids, probs, last, _ = self._outstanding.popleft()
        if self._stale(base_len, last):
            raise StaleProposal(
                f"proposal at length {base_len} is stale: the session holds {self.target.length}"
            )
        return self._verify(base_len, token_ids, probs)

    def _skip_abandoned(self) -> None:
        while self._outstanding and self._outstanding[0][4]:
            base_len, _, _, last, _ = self._outstanding.popleft()
            if not self._stale(base_len, last):
                raise RuntimeError(
                    f"a proposal abandoned at length {base_len} would have been applied"
                )

    def _stale(self, base_len: int, last: int | None) -> bool:
        return base_len != self.target.length or (
            last is not None and last != self.target.last_token_id
        )

    def _verify(self, base_len: int, proposal: list[int] | TokenTree, probs) -> VerifyResult:
        if isinstance(proposal, TokenTree):
            return self.target.verify_tree(base_len, proposal, probs)
        return self.target.verify(base_len, proposal, probs)

    def decode(
        self,
        base_len: int,
        max_tokens: int,
        until: LookupStop | None = None,
        lookup: LookupRounds | None = None,
    ) -> Iterator[VerifyResult]:
        self._skip_abandoned()
        assert not self._outstanding, "a stretch starts with nothing in flight"
        return self.target.decode(base_len, max_tokens, until, lookup)


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]  # generated tokens, a stop token included
    finish_reason: FinishReason
    stats: GenerationStats


class SpeculativeGenerator:
    """Target + drafter in one process: the reference for the services' behaviour."""

    def __init__(
        self,
        target: LoadedModel,
        drafter: Drafter | None = None,
        pipelined: bool = False,
        features: Features = Features(),
    ):
        """pipelined: draft ahead as across the network (LocalVerifier), for tests;
        features: the optimisations around the round loop."""
        if drafter is not None:
            check_compatible(target.name, target.fingerprint, drafter.name, drafter.fingerprint)
        self.target = target
        self.drafter = drafter
        self.pipelined = pipelined
        self.features = features
        # What adaptive calls measured of the costs: it seeds the next call's policy (as
        # the draft service does per target), so a call can decide before measuring.
        self.measured_costs: MeasuredCosts | None = None

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        k: int | SpeculationPolicy = 4,
    ) -> GenerationResult:
        """Generates with speculation (k = 0 or no drafter: target-only decoding)."""
        start = time.perf_counter_ns()
        params.validate()
        policy = (
            k if isinstance(k, SpeculationPolicy) else FixedK(validate_num_speculative_tokens(k))
        )
        # priced by the target's own timing; seeded with what the call before measured
        earlier = self.measured_costs if isinstance(policy, AdaptiveK) else None
        policy.start_call(step_costs(self.target.model), earlier)
        target = TargetSession(self.target, prompt_token_ids, params)
        draft = self._open_draft(prompt_token_ids, params, policy)
        stats = GenerationStats(prefill_ns=time.perf_counter_ns() - start)
        token_ids: list[int] = []
        try:
            verifier = LocalVerifier(target, overlaps=self.pipelined)
            for result in speculation_rounds(
                verifier,
                draft,
                len(prompt_token_ids),
                params,
                policy,
                self.target.context_length,
                self.features,
            ):
                token_ids += result.token_ids
                stats.record_round(result.stats)
                finish_reason = result.finish_reason
        finally:
            target.release()
            if draft is not None:
                draft.release()
            self.measured_costs = policy.end_call() or self.measured_costs
        stats.total_ns = time.perf_counter_ns() - start
        return GenerationResult(token_ids, finish_reason, stats)

    def _open_draft(self, prompt_token_ids, params, policy) -> DraftSession | None:
        if self.drafter is None or policy.max_k == 0:
            return None
        return self.drafter.open(prompt_token_ids, params)
