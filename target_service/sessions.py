"""The worker's target sessions: KV caches in a SessionCache (service_common.session_cache),
prefilled and stepped by the model's StepScheduler.

A call that grows a session reserves its growth first (prompt length, k + 1 for a
proposal, ...). The cache evicts sessions in use too (`evicts_in_use=True`): a call holds
its session for one step, or stops within one when asked (a run of decoded tokens), and
the evicted session is released once the call lets go.

Locks: the cache's two (its table's, then one per session), then the model's
`StepScheduler` (model_runtime/step_scheduler.py): every forward pass runs on its thread,
the work of every session that has some batched into one pass per step. A caller holds
its session's lock while its work waits for and runs in a step, so a session has at most
one job in the scheduler.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from model_runtime.loading import LoadedModel
from model_runtime.step_scheduler import StepLoad, StepScheduler
from service_common.session_cache import CachedSession, SessionCache
from speculative.sampling import SamplingParams
from speculative.target import TargetSession, check_prompt


@dataclass(eq=False)
class TargetEntry(CachedSession):
    target: TargetSession | None = None  # None while the prompt is being prefilled
    # Committed tokens as of the last finished call, in tokens: read by the budget while a
    # step grows the session, whose growth `reserved` still counts.
    committed_len: int = 0

    @property
    def length(self) -> int:
        return self.committed_len

    def settle(self) -> None:
        if self.target is not None:
            self.committed_len = self.target.length

    def release(self) -> None:
        if self.target is not None:
            self.target.release()


class TargetSessions(SessionCache[TargetEntry]):
    """The session cache of a target worker, with the prefill and the steps its calls run."""

    def __init__(
        self,
        loaded: LoadedModel,
        max_sessions: int,
        max_cached_tokens: int,
        compute: StepScheduler | None = None,
    ):
        super().__init__("target", max_sessions, max_cached_tokens, evicts_in_use=True)
        self.loaded = loaded
        self.compute = compute or StepScheduler(loaded.model)

    def open(
        self,
        session_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        resumes: bool = False,
    ) -> tuple[int, StepLoad | None]:
        """Creates and prefills a session (in the scheduler's steps); returns the
        prefill's wall time in nanoseconds and its steps' load. resumes: the prompt
        resumes a stream a client is reading (StepScheduler.submit)."""
        check_prompt(prompt_token_ids, self.loaded.vocab_size, self.loaded.context_length)
        with self.adding(TargetEntry(session_id), len(prompt_token_ids)) as entry:
            start = time.perf_counter_ns()
            target = TargetSession(self.loaded, prompt_token_ids, params, prefill=False)
            _, load = self.compute.submit(target.prefill_steps(), resumes=resumes)
            target.prefill_ns = time.perf_counter_ns() - start
            entry.target = target
            return target.prefill_ns, load

    @contextlib.contextmanager
    def use(
        self, session_id: str, growth: int = 0, stop: threading.Event | None = None
    ) -> Iterator[TargetSession]:
        """The session, locked for the caller, with room reserved for `growth` more
        tokens (SessionCache.locked, `stop` included). Submit its forward passes to
        `compute`."""
        with self.locked(session_id, growth=growth, stop=stop) as entry:
            yield entry.target
