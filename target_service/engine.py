"""The target worker's engine: its sessions' work on the shared forward steps, in core types (no protos;
`target_service.servicer` converts)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from foundation.errors import InvalidArgument, StaleProposal
from model_runtime.step_scheduler import StepLoad
from speculative.prompt_lookup import LookupRounds, LookupStop
from speculative.sampling import SamplingParams, SparseProbs
from speculative.target import DecodedPass, TargetSession, VerifyResult
from speculative.token_tree import TokenTree
from target_service.sessions import TargetSessions

log = logging.getLogger(__name__)

# Tokens a decode run reserves and decodes while holding its session: the KV budget
# sees at most this many tokens ahead; a close or eviction waits at most one step.
DECODE_RUN_TOKENS = 64


@dataclass(frozen=True)
class At:
    """Where a request applies: a session at a committed length."""

    session_id: str
    base_len: int
    expected_last_token_id: int | None = (
        None  # the last token it assumes (drafted before the last verdict came)
    )


class Discarded(Exception):
    """The request does not match its session (stale or duplicated): nothing applied. Answered in-band."""

    def __init__(self, committed_len: int):
        super().__init__(f"discarded: the session holds {committed_len} committed tokens")
        self.committed_len = committed_len


@dataclass(frozen=True)
class Verified:
    result: VerifyResult
    load: StepLoad | None  # the step that ran its pass
    context_length: int


@dataclass(frozen=True)
class Pass:  # one pass of decoding, as the engine ran it
    decoded: DecodedPass
    load: StepLoad | None
    start_ns: int  # when the pass before it was decided (the run's start for the first)


class TargetEngine:
    def __init__(self, sessions: TargetSessions):
        self.sessions = sessions

    def verify(
        self,
        at: At,
        draft_token_ids: Sequence[int],
        draft_probs: Sequence[SparseProbs] | None,
        sampling: SamplingParams | None,
        parents: Sequence[int] | None = None,
    ) -> Verified:
        """One round in one batched pass, its verdict applied (and `sampling` from now on);
        parents: the proposal is a token tree (speculative.token_tree)."""
        # checked first
        tree = None if parents is None else TokenTree(tuple(draft_token_ids), tuple(parents))
        with self.sessions.use(at.session_id, growth=len(draft_token_ids) + 1) as target:
            _check_matches(target, at)
            with _sampling_applied(target, sampling):
                if tree is None:
                    steps = target.verify_steps(at.base_len, draft_token_ids, draft_probs)
                else:
                    steps = target.verify_tree_steps(at.base_len, tree, draft_probs)
                result, load = self.sessions.compute.submit(steps, key=at.session_id)
            return Verified(result, load, target.context_length)

    def extend(self, at: At, token_ids: list[int], resumes: bool = False) -> tuple[int, int]:
        """The next turn's input prefilled, batched; returns the committed length and the prefill's time (ns).
        resumes: the tokens resume a stream a client is reading (StepScheduler.submit)."""
        if not token_ids:  # as on the draft worker: nothing to extend is a mistake
            raise InvalidArgument("no token ids given: send at least one")
        with self.sessions.use(at.session_id, growth=len(token_ids)) as target:
            start = time.perf_counter_ns()
            self.sessions.compute.submit(
                target.extend_steps(at.base_len, token_ids), resumes=resumes
            )
            return target.length, time.perf_counter_ns() - start

    def truncate(self, session_id: str, length: int) -> int:
        """Rolls the session back to an absolute committed length; returns it."""
        with self.sessions.use(session_id) as target:
            if not 1 <= length <= target.length:
                raise InvalidArgument(
                    f"truncate length must be in [1, {target.length}] (the session's committed "
                    f"length), got {length}"
                )
            target.truncate_to(length)
            return target.length

    def start_stretch(self, at: At, sampling: SamplingParams | None) -> int:
        """Checks a stretch and applies its sampling; returns the context length."""
        with self.sessions.use(at.session_id) as target:
            _check_matches(target, at)
            if sampling is not None:
                target.set_sampling(sampling)
            return target.context_length

    def start_decode(self, at: At, max_tokens: int, sampling: SamplingParams | None) -> int:
        """Checks a Decode stream's start and applies its sampling; returns how many tokens it decodes."""
        if max_tokens < 0:  # checked before the session is touched
            raise InvalidArgument(
                f"max_tokens must be >= 0 (0 = up to max_new_tokens), got {max_tokens}"
            )
        with self.sessions.use(at.session_id) as target:
            if at.base_len != target.length:
                raise StaleProposal(
                    f"decode from length {at.base_len} but the session has {target.length} committed tokens"
                )
            if sampling is not None:
                target.set_sampling(sampling)
            return min(target.params.max_new_tokens, max_tokens or target.params.max_new_tokens)

    def decode(
        self,
        session_id: str,
        base_len: int,
        max_tokens: int,
        until: LookupStop | None = None,
        lookup: LookupRounds | None = None,
        active: Callable[[], bool] = lambda: True,
    ) -> Iterator[Pass]:
        """Up to max_tokens tokens decoded from base_len (with `lookup`, verifying prompt lookup's too), a pass at
        a time, in runs of DECODE_RUN_TOKENS (a token every step, never waited for). Ends where decoding ends, or
        once `active()` is false (the caller went away); a closed or evicted session ends it (NOT_FOUND)."""
        decoded, length, last_ns = 0, base_len, time.time_ns()
        # a pass's rejected tokens, cached until cut
        extra = lookup.max_draft_tokens if lookup is not None else 0
        while decoded < max_tokens:
            size = min(DECODE_RUN_TOKENS, max_tokens - decoded)
            stop = threading.Event()
            progressed = False
            with self.sessions.use(session_id, growth=size + extra, stop=stop) as target:
                # lookups fill up to the call's room, counted from this run's start
                run_lookup = (
                    dataclasses.replace(lookup, room=max(lookup.room - decoded, 0))
                    if lookup
                    else None
                )
                run = target.decode_steps(length, size, until, run_lookup, stop)
                with contextlib.closing(
                    self.sessions.compute.stream(run, key=session_id)
                ) as passes:
                    for one, load in passes:
                        yield Pass(one, load, last_ns)
                        decoded, length, last_ns, progressed = (
                            decoded + len(one.result.token_ids),
                            one.result.committed_len,
                            one.emitted_ns,
                            True,
                        )
                        if one.ends or not active():
                            return
            if not progressed and not stop.is_set():  # the context is full: nothing to decode
                return


def _check_matches(target: TargetSession, at: At) -> None:
    if at.base_len != target.length or (
        at.expected_last_token_id is not None and target.last_token_id != at.expected_last_token_id
    ):
        log.debug(
            "discarded proposal",
            extra={
                "fields": {
                    "session_id": at.session_id,
                    "base_len": at.base_len,
                    "committed_len": target.length,
                }
            },
        )
        raise Discarded(target.length)


@contextlib.contextmanager
def _sampling_applied(target: TargetSession, sampling: SamplingParams | None) -> Iterator[None]:
    """Sets the proposal's sampling; a refused proposal restores the previous params, changing nothing."""
    previous = (target.params, target.generator)
    if sampling is not None:
        target.set_sampling(sampling)
    try:
        yield
    except BaseException:
        target.params, target.generator = previous
        raise
