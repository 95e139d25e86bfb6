"""The target's side of a round: score a proposal in one forward pass, decide, roll back.

`TargetSession` is what the target service holds per session and what the in-process
generator calls directly. Target-only decoding is the same call with no draft tokens.

Each call that needs the model comes in two forms: `verify(...)` runs its pass alone;
`verify_steps(...)` is the same work as ForwardSteps (model_runtime.model_session), so
that the target worker's step scheduler runs its pass batched with other sessions'.
The session's decision, sampling generator and rollback are the same either way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from foundation.errors import InvalidArgument, StaleProposal
from foundation.limits import MAX_TREE_NODES
from model_runtime.loading import LoadedModel
from model_runtime.model_session import Emit, ForwardSteps, ModelSession, run_alone, stream_alone
from speculative.prompt_lookup import LookupRounds, LookupStop
from speculative.rejection import (
    check_draft_probs,
    check_draft_tokens,
    check_tree_probs,
    verify_greedy,
    verify_sampled,
    verify_tree_greedy,
    verify_tree_sampled,
)
from speculative.sampling import SamplingParams, SparseProbs, logits_to_probs, make_generator
from speculative.token_tree import TokenTree
from speculative.types import Verdict, VerifyResult


def check_prompt(prompt_token_ids: Sequence[int], vocab_size: int, context_length: int) -> None:
    """Raises InvalidArgument for an empty, out-of-vocabulary or too long prompt."""
    if not prompt_token_ids:
        raise InvalidArgument("prompt is empty: give at least one token")
    check_room(len(prompt_token_ids), context_length)
    check_vocabulary(prompt_token_ids, vocab_size)


def check_room(length: int, context_length: int) -> None:
    if length >= context_length:
        raise InvalidArgument(
            f"prompt of {length} tokens leaves no room to generate in the "
            f"model's context length of {context_length} tokens"
        )


def check_vocabulary(token_ids: Sequence[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(
            f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )


@dataclass(frozen=True)
class DecodedPass:
    """One pass of target-only decoding."""

    result: VerifyResult
    accepted: list[int]  # the looked-up tokens it accepted (a stretch verifying prompt lookup)
    ends: bool  # decoding ends after it (a stop token, a full context, text to copy)
    emitted_ns: int  # when it was decided (wall clock)


class TargetSession:
    """One sequence on the target model and the request's sampling state."""

    def __init__(
        self,
        loaded: LoadedModel,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prefill: bool = True,
    ):
        """prefill=False leaves the prompt to `prefill_steps` (a scheduler runs it)."""
        check_prompt(prompt_token_ids, loaded.vocab_size, loaded.context_length)
        self.model = loaded.model
        self.vocab_size = loaded.vocab_size
        self.context_length = loaded.context_length
        self.params = params.validate()
        self.generator = make_generator(params.seed)
        self.session = ModelSession(loaded.model, loaded.context_length)
        self.session.append(prompt_token_ids)
        self.prefill_ns = 0  # time of the prompt's prefill, in nanoseconds
        if prefill:
            start = time.perf_counter_ns()
            self.session.prefill()
            self.prefill_ns = time.perf_counter_ns() - start

    def prefill_steps(self) -> ForwardSteps[None]:
        """Caches every token but the last, in as many passes as the scheduler cuts it into."""
        return self.session.prefill_steps()

    @property
    def length(self) -> int:
        """Committed tokens: every verdict ends with all of them decided."""
        return self.session.length

    def verify(
        self,
        base_len: int,
        draft_token_ids: Sequence[int],
        draft_probs: Sequence[SparseProbs] | None = None,
    ) -> VerifyResult:
        """Scores the proposal, commits its accepted prefix and one more token.

        base_len must equal the committed length: a stale or repeated proposal raises
        StaleProposal and changes nothing.
        """
        return run_alone(self.model, self.verify_steps(base_len, draft_token_ids, draft_probs))

    def verify_steps(
        self,
        base_len: int,
        draft_token_ids: Sequence[int],
        draft_probs: Sequence[SparseProbs] | None = None,
    ) -> ForwardSteps[VerifyResult]:
        """`verify` as one forward pass for a scheduler to run."""
        self._check_base(base_len)
        self._check_proposal(draft_token_ids, draft_probs)
        self.session.append(draft_token_ids)
        segment = self.session.pending_segment(len(draft_token_ids) + 1)
        try:
            logits, forward_ns = yield segment  # logits: [k + 1, vocab_size]
        except BaseException:  # the pass failed: the proposal was never applied
            self.session.truncate_to(base_len)
            raise
        start = time.perf_counter_ns()
        self.session.segment_done(segment)
        verdict = self._decide(draft_token_ids, draft_probs, logits)
        token_ids, stopped = self._commit(
            base_len, verdict.committed_tokens(draft_token_ids), verdict.num_accepted
        )
        # 0 where no pass ran (the logits kept from the prompt's prefill): such a
        # round says nothing of what a pass costs.
        compute_ns = (
            0 if segment.ready_logits is not None else forward_ns + time.perf_counter_ns() - start
        )
        return VerifyResult(
            verdict, token_ids, self.length, stopped, compute_ns, num_drafted=len(draft_token_ids)
        )

    def verify_tree(
        self,
        base_len: int,
        tree: TokenTree,
        draft_probs: Sequence[SparseProbs | None] | None = None,
    ) -> VerifyResult:
        """`verify` of a token tree: the path the target keeps and one more token."""
        return run_alone(self.model, self.verify_tree_steps(base_len, tree, draft_probs))

    def verify_tree_steps(
        self,
        base_len: int,
        tree: TokenTree,
        draft_probs: Sequence[SparseProbs | None] | None = None,
    ) -> ForwardSteps[VerifyResult]:
        """`verify_tree` as one forward pass over every node for a scheduler to run;
        VerifyResult.token_ids holds the kept path's tokens, then the next token."""
        self._check_base(base_len)
        if len(tree) > MAX_TREE_NODES:
            raise InvalidArgument(
                f"a token tree of {len(tree)} tokens is over the limit of {MAX_TREE_NODES}"
            )
        self._check_proposal(tree.token_ids, draft_probs, tree)
        segment = self.session.tree_segment(tree.token_ids, tree.parents)
        logits, forward_ns = yield segment  # nothing is applied before the pass ran
        start = time.perf_counter_ns()
        if self.params.greedy:
            path, verdict = verify_tree_greedy(tree, logits)
        else:
            path, verdict = verify_tree_sampled(
                tree, draft_probs, logits_to_probs(logits, self.params), self.generator
            )
        self.session.tree_done(segment, path)
        token_ids, stopped = self._commit(
            base_len, [*tree.path_tokens(path), verdict.next_token_id], len(path)
        )
        compute_ns = forward_ns + time.perf_counter_ns() - start
        return VerifyResult(
            verdict,
            token_ids,
            self.length,
            stopped,
            compute_ns,
            num_drafted=len(tree),
            path=tuple(path),
        )

    def decode(
        self,
        base_len: int,
        max_tokens: int,
        until: LookupStop | None = None,
        lookup: LookupRounds | None = None,
    ) -> Iterator[VerifyResult]:
        """`decode_steps` run alone: each pass's result."""
        for decoded in stream_alone(
            self.model, self.decode_steps(base_len, max_tokens, until, lookup)
        ):
            yield decoded.result

    def decode_steps(
        self,
        base_len: int,
        max_tokens: int,
        until: LookupStop | None = None,
        lookup: LookupRounds | None = None,
        stop: threading.Event | None = None,
    ) -> ForwardSteps[None]:
        """Target-only decoding as a streaming job: up to max_tokens tokens from
        base_len, a pass each, or, with `lookup`, passes that also verify the tokens
        prompt lookup finds to copy (a prompt-lookup drafter's rounds, run by the
        target; the pass that reaches max_tokens verifies up to `lookup.room`, so it
        may end past it); each pass emitted as a DecodedPass once decided. Ends after a stop
        token, a full context, the first token at which prompt lookup with `until`'s
        sizes finds text to copy (the n-gram drafter would propose again), or once
        `stop` is set."""
        length, left = base_len, max_tokens
        # what lookups may fill
        room = max(lookup.room, max_tokens) if lookup is not None else max_tokens
        while (
            left > 0 and length < self.context_length and not (stop is not None and stop.is_set())
        ):
            proposal = self.lookup_proposal(room, lookup)
            result = yield from self.verify_steps(length, proposal)
            ends = self.decoding_ends(result, until)
            yield Emit(
                DecodedPass(result, proposal[: result.verdict.num_accepted], ends, time.time_ns())
            )
            if ends:
                return
            length, left, room = (
                result.committed_len,
                left - len(result.token_ids),
                room - len(result.token_ids),
            )

    def lookup_proposal(self, max_tokens: int, lookup: LookupRounds | None) -> list[int]:
        """What the next pass of a stretch that may still decode max_tokens tokens
        verifies: nothing, or with `lookup` the tokens prompt lookup finds to copy."""
        if lookup is None:
            return []
        return lookup.proposal(
            self.session.token_ids, min(max_tokens, self.context_length - self.length)
        )

    def decoding_ends(self, result: VerifyResult, until: LookupStop | None = None) -> bool:
        """Whether target-only decoding ends after `result`: a stop token, a full
        context, or (with `until`) text to copy."""
        if result.stopped or result.committed_len >= self.context_length:
            return True
        return until is not None and until.matches(self.session.token_ids)

    def _decide(self, draft_token_ids, draft_probs, logits: torch.Tensor) -> Verdict:
        if self.params.greedy:
            return verify_greedy(draft_token_ids, logits)
        if draft_probs is None:  # a deterministic proposal: one-hot distributions
            draft_probs = [SparseProbs.one_hot(t) for t in draft_token_ids]
        probs = logits_to_probs(logits, self.params)
        return verify_sampled(draft_token_ids, draft_probs, probs, self.generator)

    def _commit(
        self, base_len: int, token_ids: list[int], num_cached: int
    ) -> tuple[list[int], bool]:
        """Commits token_ids after base_len, cut after a stop token (then True), of which the
        first num_cached are in the KV cache already (the rest of the pass is rolled back)."""
        stopped = next(
            (i for i, token_id in enumerate(token_ids) if token_id in self.params.stop_token_ids),
            None,
        )
        if stopped is not None:
            token_ids = token_ids[: stopped + 1]
        self.session.truncate_to(base_len + min(num_cached, len(token_ids)))
        self.session.append(token_ids[num_cached:])
        return token_ids, stopped is not None

    def _check_base(self, base_len: int, request: str = "proposal extends length") -> None:
        """A stale or repeated request raises StaleProposal before it changes anything."""
        if base_len != self.length:
            raise StaleProposal(
                f"{request} {base_len} but the session has {self.length} committed tokens"
            )

    def _check_proposal(self, draft_token_ids, draft_probs, tree: TokenTree | None = None) -> None:
        check_draft_tokens(draft_token_ids, self.vocab_size)
        if self.length + len(draft_token_ids) + 1 > self.context_length:
            raise InvalidArgument(
                f"proposal of {len(draft_token_ids)} tokens after {self.length} would pass the "
                f"context length of {self.context_length} tokens"
            )
        if draft_probs is not None:
            if tree is None:
                check_draft_probs(draft_token_ids, draft_probs)
            else:  # one per node, None where the node is deterministic
                check_tree_probs(tree, draft_probs)
            for probs in filter(None, draft_probs):
                check_draft_tokens(probs.token_ids.tolist(), self.vocab_size)

    @property
    def last_token_id(self) -> int:
        return self.session.last_token_id

    @property
    def cached_tokens(self) -> int:
        """Tokens whose keys and values the KV cache holds (the memory it uses)."""
        return self.session.cached_length

    def extend(self, base_len: int, token_ids: Sequence[int]) -> None:
        """Appends new input (the next turn) and prefills it, reusing the KV cache."""
        run_alone(self.model, self.extend_steps(base_len, token_ids))

    def extend_steps(self, base_len: int, token_ids: Sequence[int]) -> ForwardSteps[None]:
        """`extend` as forward passes for a scheduler to run."""
        self._check_base(base_len, "extend at length")
        check_room(self.length + len(token_ids), self.context_length)
        check_vocabulary(token_ids, self.vocab_size)  # the committed tokens were checked
        self.session.append(token_ids)
        yield from self.prefill_steps()

    def set_sampling(self, params: SamplingParams) -> None:
        """New sampling params from now on; a seed restarts the generator."""
        self.params = params.validate()
        if params.seed is not None:
            self.generator = make_generator(params.seed)

    def truncate_to(self, length: int) -> None:
        if length < 1:
            raise InvalidArgument(
                f"a session keeps at least one token; cannot truncate to {length}"
            )
        self.session.truncate_to(length)

    def release(self) -> None:
        self.session.release()
