"""The target worker's compute thread as a step scheduler: continuous batching.

Every call that needs the model hands its work in as ForwardSteps
(model_runtime.model_session): a generator that yields one Segment per forward pass and
decides on the logits it is sent. Each step, the scheduler gathers the next segment of
every job that has one, up to `max_batch_tokens`, runs them in ONE forward pass
(model_runtime.batched_forward), and resumes each job with its logits; a job that
yields again joins a later step. Steps follow one another with no waiting for a batch
to fill: whatever arrived during a step joins the next.

Rules:
- Running sessions first: segments that need logits (proposals, decode steps) are
  taken oldest first; prefill chunks fill the rest of the budget, cut to fit (the
  chunk that ends a prompt also gives its last token's logits, kept for the session's
  next call, which then runs no pass: a step that ran none is left out of the cost fit).
- A prompt's prefill stalls the sessions decoding by at most a share of their work
  (stall-free batching, Sarathi-Serve, Agrawal et al., OSDI 2024): while a step holds
  segments that need logits, its prefill chunks may lengthen it by at most
  `prefill_share` of what those cost, priced by the fitted step cost (at least one
  token a step, so a prompt always advances; no cap while a prefill token's price is
  unknown). A step with no one decoding gives prefill the whole budget: the time to
  first token is all that waits.
- A prefill that resumes a stream its client is already reading (a failover's
  re-prefill of the committed tokens) is running work, not a new prompt: its client is
  stalled mid-stream until it ends, so its chunks come right after the segments that
  need logits and are held to the budget only, not to the prefill share.
- The oldest job always gets into a step, whatever its size: nothing starves.
- A step waits for stragglers while that costs less than it saves: a call's next work
  arrives a little after its last result (the stream's next message, a draft's next
  proposal), and a call that misses a step loses a whole step. Waiting t costs each
  ready call t, missing costs each late one a step, so the break-even wait is the last
  step's time times the share of running calls (`expected_jobs`) still missing. Within
  it, a step waits only for the calls expected back in time: each call's turn-around
  (from its last result to its next work, per `key`) is measured, and a call whose
  turn-around is longer than the window (a draft model drafting) is not waited for.
- A streaming job (a run of tokens the target decodes alone: a Decode stream, a
  stretch) stays in the steps until it ends: it hands each token out as it goes
  (`Emit`, delivered when its step ends) and has its next segment ready at once, so
  it never misses a step and is never waited for; its caller reads the tokens from
  `stream` and stops it by closing that iterator.
- A job's own state (its session, sampling generator, rollback) is touched only by its
  generator, on this thread; batching changes which pass computes a segment, never
  what the job decides.

Also runs plain functions between steps (`run`): loading, warm-up. Why one thread:
torch's OpenMP intra-op pool runs fastest on the thread that first ran torch work
(calls from gRPC handler threads were measured markedly slower), and on a CPU torch
already spreads one pass over every core, so concurrent passes would only contend.
"""

from __future__ import annotations

import collections
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TypeVar

from transformers import PreTrainedModel

from foundation.errors import InvalidArgument
from foundation.load import StepLoad
from foundation.pass_cost import Moments, PassCost, fit_pass_cost
from model_runtime.batched_forward import Segment, forward_segments
from model_runtime.model_session import Emit, ForwardSteps, run_alone

T = TypeVar("T")

# While sessions decode, prefill chunks may lengthen a step by at most this share of
# its decoding work: a running session's time per token stays within 1.5x of what
# decoding costs, and a prompt still advances by half a step's worth each step
# (docs/batching.md: the trade against time to first token, measured).
PREFILL_SHARE = 0.5
# Steps remembered for the batch occupancy a worker reports (WorkerLoad).
RECENT_STEPS = 64
# Weight of the past in each caller's measured turn-around.
TURNAROUND_DECAY = 0.8
# A caller away this long has ended its call (or will be measured anew): forgotten.
FORGET_AFTER_NS = 60 * 10**9
_DONE = object()  # on a streaming job's outbox: the job ended (its outcome is in its future)


class StreamClosed(Exception):
    """Thrown into a streaming job whose caller stopped reading: it rolls back and ends."""


class _Turnarounds:
    """When each caller (key) is expected back with work: its last result's time plus
    its measured turn-around (a decayed average). Touched only on the compute thread."""

    def __init__(self):
        self._mean_ns: dict[object, float] = {}
        self._away_since: dict[object, int] = {}  # keys whose last job finished, not yet back

    def left(self, key: object, now_ns: int) -> None:
        if key is not None:
            self._away_since.pop(key, None)
            self._away_since[key] = now_ns  # insertion order is time order: the oldest first
            self._forget_gone(now_ns)

    def _forget_gone(self, now_ns: int) -> None:
        """Drops the callers away for long (their call ended), oldest first. wait_until
        does too, but runs only while steps wait for callers: a worker serving one call
        at a time kept an entry per session it ever served."""
        while self._away_since:
            key, since = next(iter(self._away_since.items()))
            if now_ns - since <= FORGET_AFTER_NS:
                return
            del self._away_since[key]
            self._mean_ns.pop(key, None)

    def back(self, key: object, now_ns: int) -> None:
        since = self._away_since.pop(key, None)
        if since is not None:
            old = self._mean_ns.get(key)
            gap = now_ns - since
            self._mean_ns[key] = (
                gap if old is None else TURNAROUND_DECAY * old + (1 - TURNAROUND_DECAY) * gap
            )

    def wait_until(self, window_end_ns: float, now_ns: int) -> float:
        """Until when a step should wait, within the window: the last moment a caller
        is expected back inside it (the window's end for one whose turn-around is not
        known yet). Callers already late are not waited for; those away for long are
        forgotten (their call ended)."""
        latest = now_ns
        for key, since in list(self._away_since.items()):
            if now_ns - since > FORGET_AFTER_NS:
                del self._away_since[key]
                self._mean_ns.pop(key, None)
                continue
            expected = since + self._mean_ns[key] if key in self._mean_ns else window_end_ns
            if expected <= window_end_ns:
                latest = max(latest, expected)
        return min(latest, window_end_ns)


class _Job:
    def __init__(
        self,
        steps: ForwardSteps,
        key: object = None,
        streaming: bool = False,
        resumes: bool = False,
    ):
        self.steps = steps
        self.key = key  # the caller's stream (e.g. its session): turn-arounds are per key
        self.resumes = (
            resumes  # its prefill resumes a stream its client reads: not held to the prefill share
        )
        self.future: Future = Future()
        self.segment: Segment | None = None  # the pass it waits for
        self.ready_ns = time.perf_counter_ns()  # since when it waits for a step
        self.queue_ns = 0  # waited for steps (a streaming job: since its last delivery)
        self.load: StepLoad | None = None
        # A streaming job's values for its caller: emitted, then delivered to the outbox.
        self.outbox: queue.SimpleQueue | None = queue.SimpleQueue() if streaming else None
        self.emitted: list = []
        self.cancelled = False  # set by a streaming job's caller that stopped reading

    @property
    def prefill(self) -> bool:
        return self.segment is not None and (self.segment.fill or self.segment.num_logits == 0)

    @property
    def shared(self) -> bool:
        """A prefill chunk held to the prefill share: a new prompt's, not a resumed stream's."""
        return self.prefill and not self.resumes

    def advance(self, value=None) -> bool:
        """Resumes the generator (first call: value None); False once it is done, its
        outcome kept for `finish`."""
        try:
            item = self.steps.send(value) if value is not None else next(self.steps)
            while isinstance(item, Emit):
                assert self.outbox is not None, "only a streaming job emits"
                self.emitted.append(item.value)
                item = next(self.steps)
            self.segment = item
        except StopIteration as done:
            self._outcome = (True, done.value)
            return False
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            self._outcome = (False, error)
            return False
        self.ready_ns = time.perf_counter_ns()
        return True

    def deliver(self) -> None:
        """Hands a streaming job's emitted values to its caller, each with the load of
        the step that ended last (its queueing counted since the last delivery); for
        any other job, nothing to do."""
        if self.emitted:
            for value in self.emitted:
                self.outbox.put((value, self.load))
            self.emitted.clear()
            self.queue_ns = 0

    def finish(self) -> None:
        """Hands the outcome to the caller."""
        succeeded, value = self._outcome
        if succeeded:
            self.future.set_result((value, self.load))
        else:
            self.future.set_exception(value)
        self._close_outbox()

    def fail(self, error: BaseException) -> None:
        """The step's pass failed (or the caller left): the generator rolls back (it
        sees the error)."""
        try:
            self.steps.throw(error)
        except BaseException:  # noqa: BLE001 - the error itself, or what rollback raised
            pass
        self.future.set_exception(error)
        self._close_outbox()

    def _close_outbox(self) -> None:
        if self.outbox is not None:
            self.deliver()
            self.outbox.put(_DONE)


class StepScheduler:
    def __init__(
        self,
        model: PreTrainedModel | None = None,
        max_batch_tokens: int = 512,
        name: str = "model-compute",
        expected_jobs: Callable[[], int] | None = None,
        prefill_share: float = PREFILL_SHARE,
    ):
        """expected_jobs: how many calls may bring work for the next step (e.g. the
        calls running on the worker); None = do not wait for any. prefill_share: the
        most a step's prefill chunks may add to its decoding work's time (0: no cap)."""
        if max_batch_tokens < 1:
            raise InvalidArgument(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        if prefill_share < 0:
            raise InvalidArgument(f"prefill_share must be >= 0, got {prefill_share}")
        self.model = model  # may be set after loading it on this thread
        self.max_batch_tokens = max_batch_tokens
        self.prefill_share = prefill_share
        self._cost = PassCost()  # the fitted step cost (foundation/pass_cost.py)
        self.expected_jobs = expected_jobs
        self._last_step_ns = 0
        self._last_end_ns = 0
        self._turnarounds = _Turnarounds()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: list[_Job] = []  # waiting for a step, oldest first
        self._recent: collections.deque[tuple[int, int, int]] = collections.deque(
            maxlen=RECENT_STEPS
        )
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, steps: ForwardSteps[T], key: object = None, resumes: bool = False
    ) -> tuple[T, StepLoad | None]:
        """Runs `steps` batched with other jobs; returns its result and what its steps
        were like (None if it needed no pass), or raises its error. key: the caller's
        stream (its session), whose turn-around the scheduler learns to wait for.
        resumes: its prefill resumes a stream a client is reading (see the rules)."""
        # from a step's own work: no batching, no deadlock
        if threading.current_thread() is self._thread:
            return run_alone(self.model, steps), None
        job = _Job(steps, key, resumes=resumes)
        self._queue.put(job)
        return job.future.result()

    def stream(
        self, steps: ForwardSteps[T], key: object = None
    ) -> Iterator[tuple[object, StepLoad | None]]:
        """Runs a streaming job batched with other jobs: yields each value it emits
        with the load of the step that produced it, as its steps end, and raises its
        error if it fails. Closing the iterator early stops the job: it leaves the
        steps, its pending work rolled back, before close() returns."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("a streaming job cannot be run from the compute thread")
        job = _Job(steps, key, streaming=True)
        self._queue.put(job)
        try:
            while (item := job.outbox.get()) is not _DONE:
                yield item
            job.future.result()
        finally:
            if not job.future.done():
                job.cancelled = True
                concurrent.futures.wait([job.future])

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Runs fn on the compute thread, between steps; returns its result."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        future: Future = Future()
        self._queue.put((fn, args, kwargs, future))
        return future.result()

    def occupancy(self) -> float:
        """Mean tokens per step over the recent steps (0 before any)."""
        recent = list(self._recent)
        return sum(tokens for tokens, _, _ in recent) / len(recent) if recent else 0.0

    def stop(self) -> None:
        self._queue.put(None)

    # On the compute thread.

    def _loop(self) -> None:
        while self._take_arrivals(block=not self._jobs) and self._gather():
            self._drop_cancelled()
            if self._jobs:
                self._step(self._pick())

    def _drop_cancelled(self) -> None:
        """Streaming jobs whose callers stopped reading leave, their work rolled back."""
        for job in [job for job in self._jobs if job.cancelled]:
            self._jobs.remove(job)
            job.fail(StreamClosed("the caller stopped reading"))
            self._turnarounds.left(job.key, time.perf_counter_ns())

    def _gather(self) -> bool:
        """Waits for the expected jobs while waiting costs less than missing them (see
        the module's rules); False on stop."""
        if self.expected_jobs is None:
            return True
        while (expected := self.expected_jobs()) > len(self._jobs):
            missing_share = (expected - len(self._jobs)) / expected
            now = time.perf_counter_ns()
            window_end = self._turnarounds.wait_until(
                self._last_end_ns + missing_share * self._last_step_ns, now
            )
            left_s = (window_end - now) * 1e-9
            if left_s <= 0:
                return True
            if not self._take_arrivals(block=True, timeout_s=left_s):
                return False
        return True

    def _take_arrivals(self, block: bool, timeout_s: float | None = None) -> bool:
        """Starts newly submitted jobs and runs plain functions; False on stop."""
        while True:
            try:
                item = self._queue.get(block=block, timeout=timeout_s)
            except queue.Empty:
                return True
            block = False
            if item is None:
                return False
            if isinstance(item, _Job):
                self._turnarounds.back(item.key, item.ready_ns)
                if item.advance():  # runs its checks; may finish with no pass at all
                    self._jobs.append(item)
                    item.deliver()
                else:
                    item.finish()
            else:
                _run_call(*item)

    def _pick(self) -> list[_Job]:
        """This step's jobs: those needing logits oldest first, then resumed streams'
        prefill chunks cut to the budget left, then new prompts' cut to it and to the
        prefill share; the oldest job always."""
        budget = self.max_batch_tokens
        picked: list[_Job] = []
        prefill_room: float | None = (
            None  # shared prefill tokens this step may still take (None: no cap)
        )
        for job in sorted(self._jobs, key=lambda j: (j.prefill, j.shared)):  # stable: oldest first
            room = budget - sum(j.segment.num_run_tokens for j in picked)
            size = job.segment.num_run_tokens
            if job.shared and picked and prefill_room is None:
                prefill_room = self._prefill_room(picked)
            if job.shared and prefill_room is not None:
                room = min(room, int(prefill_room))
            if not picked or size <= room:
                picked.append(job)
            elif job.prefill and room > 0:
                job.segment.trim(room)
                picked.append(job)
            else:
                continue
            if job.shared and prefill_room is not None:
                prefill_room -= job.segment.num_run_tokens
        return picked

    def _prefill_room(self, decoding: list[_Job]) -> float | None:
        """Prefill tokens a step whose decoding work is `decoding` may take: at most
        prefill_share of that work's fitted time, at least one; None while a prefill
        token's price is unknown or the share is off, or when nothing decodes."""
        logit_tokens = sum(job.segment.num_run_tokens for job in decoding if not job.prefill)
        if not logit_tokens or not self.prefill_share or not self._cost.per_prefill_token_ns:
            return None
        decoding_ns = self._cost.ns(logit_tokens)
        return max(1.0, self.prefill_share * decoding_ns / self._cost.per_prefill_token_ns)

    def _step(self, jobs: list[_Job]) -> None:
        start = time.perf_counter_ns()
        waiting = len(self._jobs)
        for job in jobs:
            job.queue_ns += start - job.ready_ns
            self._jobs.remove(job)
        try:
            outputs = forward_segments(self.model, [job.segment for job in jobs])
        except BaseException as error:  # noqa: BLE001 - every job of the step gets it
            for job in jobs:
                job.fail(error)
            return
        forward_ns = time.perf_counter_ns() - start
        tokens = sum(job.segment.num_tokens for job in jobs)
        run_tokens = sum(job.segment.num_run_tokens for job in jobs)
        logit_tokens = sum(job.segment.num_logits for job in jobs if job.segment.num_run_tokens)
        finished = [
            job for job, logits in zip(jobs, outputs) if not job.advance((logits, forward_ns))
        ]
        going_on = [job for job in jobs if job not in finished]
        self._jobs.extend(going_on)
        self._last_end_ns = time.perf_counter_ns()
        step_ns = self._last_end_ns - start  # the pass and every job's decision
        # a step whose logits were all ready ran no pass: it says nothing of a pass's cost
        if run_tokens:
            self._last_step_ns = step_ns
            self._recent.append((run_tokens, logit_tokens, step_ns))
        self._cost = fit_step_cost(list(self._recent))
        for job in jobs:
            job.load = StepLoad(
                job.queue_ns,
                step_ns,
                tokens,
                len(jobs),
                waiting,
                self._cost.base_ns,
                self._cost.per_token_ns,
            )
        for job in going_on:
            job.deliver()
        ready_ns = time.perf_counter_ns()
        # its next segment waits for a step from here on, not during this one's bookkeeping
        for job in going_on:
            job.ready_ns = ready_ns
        for job in finished:
            self._turnarounds.left(job.key, self._last_end_ns)
            job.finish()


def fit_step_cost(steps: list[tuple[int, int, int]]) -> PassCost:
    """The step cost over (run_tokens, logit_tokens, step_ns) triples: least squares
    of step time on the tokens that need logits (a decode step's, a proposal's) and,
    apart, those that need none (prefill chunks), whose rows skip the output layer
    and the decision and so cost less. per_token_ns is a token with logits: what one
    more draft token costs the step. All >= 0. While a regressor's sizes barely
    differ (by about one token) its slope is unknown (0) and it joins the base (every
    step costs about the same), which a wider step corrects. All 0 before any step."""
    if not steps:
        return PassCost()
    moments = Moments.of(
        xs=[logits for _, logits, _ in steps],
        cs=[cost for _, _, cost in steps],
        ps=[run - logits for run, logits, _ in steps],
    )
    return fit_pass_cost(
        moments,
        min_var=1.0,
        max_slope=moments.mean_c / max(moments.mean_x, 1.0),
        floor_base=True,
    )


def _run_call(fn, args, kwargs, future: Future) -> None:
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as error:  # noqa: BLE001 - handed to the caller
        future.set_exception(error)
