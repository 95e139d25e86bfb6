"""The fleet model: a discrete-event simulation (SimPy) of target workers, draft workers
and open-loop Poisson arrivals, speculating as the project's own policy decides.

One session's round, as simulated (the draft worker's loop, speculative/speculation_loop.py):

    action = policy.next_action(remaining)      # speculative/policy.py: k, or a stretch
    draft k tokens     on a draft device         # a step drafts one token for each session drafting
    send               one-way link delay
    verify             one batched target pass   # every session's work ready rides in it
    accept n           draws against a_1..a_k    # a seeded generator per request
    return             one-way link delay
    policy.observe_round(stats, elapsed)        # what the loop tells it, StepLoad included

A device runs one thing at a time: a target pass over all the work ready (prefills,
proposals, decode tokens), or a draft step for every session drafting. Layouts:
target-only (k = 0: the target decodes a token a pass, no draft), co-located (each target
device also drafts, for its own sessions, at the local link delay), remote (draft workers
of their own, shared by the cell's targets, behind the link). A stretch (the target
decoding alone, where the adaptive policy finds speculation losing) streams its tokens
back one way each. Not modelled: drafting ahead (rounds take turns, as the replay does),
a drafter stopping early (`min_reach`), token trees, the step scheduler's wait for
stragglers, the draft worker's session cap, early stops (every request generates
`new_tokens`), processes time-sliced on one core. Prompts ride the passes in chunks
held to the target's prefill share, as its step scheduler runs them.

A cell is the unit simulated: `targets` target workers and `drafts` draft workers with
the cell's share of the arrivals, routed to the least-loaded worker. A fleet of N targets
is N / targets such cells, independent (Poisson arrivals split at random stay Poisson):
so a fleet of any size costs one cell's simulation.
"""

from __future__ import annotations

import enum
import math
import random
import statistics
from collections.abc import Generator
from dataclasses import dataclass, field

import simpy

from foundation.load import StepLoad
from planner.costs import NS_PER_MS, Acceptance, Costs
from speculative.estimator import MeasuredCosts
from speculative.policy import AdaptiveK, FixedK, SpeculationPolicy
from speculative.stats import RoundStats
from speculative.types import NextTokenKind


class Layout(enum.Enum):
    TARGET_ONLY = "target-only"
    COLOCATED = "co-located"
    REMOTE = "remote"


@dataclass(frozen=True)
class Cell:
    """What one simulation holds."""

    layout: Layout
    targets: int = 1
    drafts: int = 0  # remote draft workers (co-located: each target drafts; target-only: none)
    one_way_ms: tuple[float, ...] | None = None  # the link's delay (None: the costs file's)

    @property
    def ratio(self) -> float:
        """Draft workers per target worker."""
        return self.drafts / self.targets


@dataclass(frozen=True)
class Speculation:
    """The policy each call runs: a fixed k, or adaptive up to max_k (k None)."""

    k: int | None
    max_k: int = 0

    def policy(self) -> SpeculationPolicy:
        return FixedK(self.k) if self.k is not None else AdaptiveK(self.max_k)

    @property
    def label(self) -> str:
        return f"k={self.k}" if self.k is not None else f"adaptive k<={self.max_k}"


TARGET_ONLY = Speculation(k=0)


@dataclass(frozen=True)
class Result:
    """One configuration at one offered rate; per target worker where a rate."""

    rate_per_s: float  # offered requests a second a target (saturation: what it served)
    tokens_per_s: float  # served output tokens a second a target
    tpot_p50_ms: float  # time per output token after the first, per request
    tpot_p90_ms: float
    ttft_p90_ms: float  # arrival to first token
    mean_queue: float  # requests waiting for admission, time-averaged, a target
    tokens_per_round: float  # output tokens a target pass of a session (1: no gain)
    drafted_per_round: float  # draft tokens a round proposed, on average
    stretch_share: float  # of the output, the share the target decoded alone (stretches)
    target_busy: float  # the share of time a target device was busy
    draft_busy: float  # the same for the remote draft devices (0: none)
    requests: int  # requests measured (after the warm-up)
    # Every request's tokens from the first arrival to the last token, a second a target:
    # what the cell serves while busy (its capacity, where the arrivals outrun it).
    busy_tokens_per_s: float = 0.0

    @property
    def overloaded(self) -> bool:
        """A saturation run: its queue, and so its TTFT, grew with the run."""
        return math.isinf(self.mean_queue)


@dataclass
class _Work:
    """Target work: a prefill, a proposal to verify or a decode token."""

    tokens: int  # with logits: k + 1 of a proposal, 1 of a decode token
    prefill: int  # prompt tokens
    ready_ms: float
    done: simpy.Event


@dataclass(frozen=True)
class _Pass:
    """A target pass as a piece of its work saw it."""

    ms: float  # the whole batched pass
    load: StepLoad  # what the worker reports with its verdicts


class Device:
    """One worker's device: target passes over the work ready and draft steps, one at a time."""

    def __init__(self, env: simpy.Environment, costs: Costs, colocated: bool):
        self.env, self.costs, self.colocated = env, costs, colocated
        self.work: list[_Work] = []  # waiting for a target pass
        self.drafting: list[list] = []  # [steps left, event] of each session drafting
        self.reads: list[tuple[int, simpy.Event]] = []  # draft prefills: (tokens, event)
        self.sessions = 0  # sessions placed here (routing)
        self.busy_ms = 0.0
        self.handed_on: MeasuredCosts | None = None  # what the last call measured (its seed)
        self._wake: simpy.Event | None = None
        env.process(self._run())

    def verify(self, tokens: int, prefill: int = 0) -> simpy.Event:
        """Joins the next target pass; the event's value is the `_Pass`."""
        done = self.env.event()
        self.work.append(_Work(tokens, prefill, self.env.now, done))
        self._poke()
        return done

    def draft(self, steps: int) -> simpy.Event:
        """`steps` draft tokens, one a draft step; fires after the last."""
        done = self.env.event()
        self.drafting.append([steps, done])
        self._poke()
        return done

    def read(self, tokens: int) -> simpy.Event:
        """The draft reads tokens (its prefill, or a stretch's tokens to catch up)."""
        done = self.env.event()
        self.reads.append((tokens, done))
        self._poke()
        return done

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _run(self) -> Generator:
        while True:
            if not (self.work or self.drafting or self.reads):
                self._wake = self.env.event()
                yield self._wake
            if self.reads or self.drafting:
                yield from self._draft_step()
                yield self.env.timeout(0)  # what comes back at once joins the next pass
            if self.work:
                yield from self._target_pass()
                # A session with no delay to cover (target-only, co-located) sends its next
                # work at once: it joins the next pass, as the step scheduler waits for it.
                yield self.env.timeout(0)

    def _draft_step(self) -> Generator:
        reads, self.reads = self.reads, []
        batch = list(self.drafting)
        draft = self.costs.draft
        ms = sum(tokens for tokens, _ in reads) * draft.prefill_token_ms
        ms += draft.step_ms(len(batch), self.colocated) if batch else 0.0
        yield self.env.timeout(ms)
        self.busy_ms += ms
        for _, done in reads:
            done.succeed()
        for entry in batch:
            entry[0] -= 1
            if entry[0] <= 0:
                self.drafting.remove(entry)
                entry[1].succeed()

    def _target_pass(self) -> Generator:
        """One pass: the work that needs logits, first come first under the token budget
        (one at least), then prefill chunks held to the prefill share, as the target's
        step scheduler builds a step (model_runtime/step_scheduler.py)."""
        target, budget = self.costs.target, self.costs.target.max_batch_tokens
        decoding = [w for w in self.work if not w.prefill]
        taken, tokens = [], 0
        for work in decoding:
            if taken and budget and tokens + work.tokens > budget:
                break
            taken.append(work)
            tokens += work.tokens
        chunks = self._prefill_chunks(len(taken), tokens, budget)
        waiting = len(self.work)
        ended = [w for w, n in chunks if n == w.prefill]
        self.work = [w for w in self.work if w not in taken and w not in ended]
        for work, n in chunks:
            work.prefill -= n
        taken += ended
        prefill = sum(n for _, n in chunks)
        logits = tokens + len(ended)  # a prompt's last chunk gives its first token's logits
        start = self.env.now
        ms = target.pass_ms(len(taken) + len(chunks) - len(ended), logits, prefill)
        yield self.env.timeout(ms)
        self.busy_ms += ms
        cost = target.step_cost(len(taken))  # what the worker reports of its steps
        for work in taken:
            load = StepLoad(
                queue_ns=int((start - work.ready_ms) * NS_PER_MS),
                step_ns=int(ms * NS_PER_MS),
                batch_tokens=logits + prefill,
                batch_sessions=len(taken),
                waiting_sessions=waiting,
                cost_base_ns=cost.base_ns,
                cost_per_token_ns=cost.per_token_ns,
            )
            work.done.succeed(_Pass(ms, load))

    def _prefill_chunks(self, rows: int, tokens: int, budget: int) -> list[tuple[_Work, int]]:
        """(prompt, its tokens in this pass) of the prompts waiting, oldest first: with
        sessions decoding, at most `prefill_share` of their pass's cost (one token at
        least); with none, the whole budget (no budget: every prompt whole)."""
        target, chunks = self.costs.target, []
        prompts = [w for w in self.work if w.prefill]
        if not prompts:
            return chunks
        # a prompt token's price: its own, or the compute floor's where that is higher
        price = max(target.prefill_ms_a_token, target.compute_per_token_ms)
        if rows and price > 0:
            decode_ms = target.pass_ms(rows, tokens)
            room = max(1, int(target.prefill_share * decode_ms / price))
        else:  # no one decoding, or prompt tokens free: no cap but the budget
            room = budget or sum(w.prefill for w in prompts)
        if budget:
            room = max(1, min(room, budget - tokens))
        for work in prompts:
            n = min(work.prefill, room)
            chunks.append((work, n))
            room -= n
            if room <= 0:
                break
        return chunks


@dataclass
class _Tally:
    """What the measured requests saw, and the window's tokens and queue."""

    window: tuple[float, float] = (0.0, float("inf"))  # ms: throughput and queue
    tpot_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    commits: list[tuple[float, int]] = field(default_factory=list)  # (ms, output tokens)
    stretch_tokens: int = 0
    rounds: int = 0
    round_tokens: int = 0
    drafted: int = 0
    waiting: int = 0
    queue_area: float = 0.0  # waiting requests x ms, inside the window
    last_change_ms: float = 0.0
    first_wait_ms: float | None = None  # when a request first waited for admission
    last_admission_ms: float = 0.0

    def tokens_per_ms(self) -> float:
        """Output tokens committed inside the window, a ms."""
        start, end = self.window
        inside = sum(count for at_ms, count in self.commits if start <= at_ms <= end)
        return inside / max(end - start, 1e-9)

    def queue(self, now_ms: float, change: int) -> None:
        start, end = max(self.last_change_ms, self.window[0]), min(now_ms, self.window[1])
        self.queue_area += self.waiting * max(0.0, end - start)
        self.waiting += change
        self.last_change_ms = now_ms
        if self.waiting > 0 and self.first_wait_ms is None:
            self.first_wait_ms = now_ms


class Simulation:
    """One cell over a list of arrivals (`run`)."""

    def __init__(
        self,
        costs: Costs,
        cell: Cell,
        speculation: Speculation,
        acceptance: Acceptance,
        seed: int = 0,
    ):
        self.costs, self.cell, self.speculation = costs, cell, speculation
        self.acceptance, self.seed = acceptance, seed
        self.env = simpy.Environment()
        remote = cell.layout is Layout.REMOTE
        self.targets = [
            Device(self.env, costs, colocated=cell.layout is Layout.COLOCATED)
            for _ in range(cell.targets)
        ]
        self.drafts = [Device(self.env, costs, colocated=False) for _ in range(cell.drafts)]
        if remote and not self.drafts:
            raise ValueError("a remote layout needs draft workers")
        self.slots = [simpy.Resource(self.env, costs.target.max_sessions) for _ in self.targets]
        delays = cell.one_way_ms if cell.one_way_ms is not None else costs.link.one_way_ms
        self.delays = delays if remote else (costs.link.local_one_way_ms,)
        self.link_random = random.Random(f"link:{seed}")
        self.tally = _Tally()
        self.measured_from = 0  # requests before this index are the warm-up
        self.first_arrival_ms = 0.0

    def run(self, arrivals_ms: list[float], warmup: int, rate_per_s: float | None) -> Result:
        """rate_per_s: the offered rate a target; None: overloaded, measured from the first
        request that waited to the last admission (while every slot was taken), the
        result's rate then what the cell served."""
        self.measured_from = warmup
        self.first_arrival_ms = arrivals_ms[0] if arrivals_ms else 0.0
        if rate_per_s is None:
            self.tally.window = (0.0, float("inf"))
        else:
            self.tally.window = (arrivals_ms[min(warmup, len(arrivals_ms) - 1)], arrivals_ms[-1])
        self.env.process(self._arrivals(arrivals_ms))
        self.env.run()
        if rate_per_s is None:
            first_wait = self.tally.first_wait_ms or 0.0
            self.tally.window = (first_wait, max(self.tally.last_admission_ms, first_wait))
        return self._result(rate_per_s)

    # --- requests ---------------------------------------------------------------------

    def _arrivals(self, arrivals_ms: list[float]) -> Generator:
        for index, at_ms in enumerate(arrivals_ms):
            if at_ms > self.env.now:
                yield self.env.timeout(at_ms - self.env.now)
            self.env.process(self._request(index))

    def _request(self, index: int) -> Generator:
        rng = random.Random(f"request:{self.seed}:{index}")  # its acceptance draws, in order
        arrival = self.env.now
        t = min(
            range(len(self.targets)), key=lambda i: self.slots[i].count + len(self.slots[i].queue)
        )
        target = self.targets[t]
        draft = self._draft_for(target)
        with self.slots[t].request() as slot:
            if not slot.triggered:  # every slot taken: it waits
                self.tally.queue(self.env.now, +1)
                yield slot
                self.tally.queue(self.env.now, -1)
            self.tally.last_admission_ms = self.env.now
            target.sessions += 1
            if draft is not None and draft is not target:
                draft.sessions += 1
            times = yield from self._generate(target, draft, rng)
            target.sessions -= 1
            if draft is not None and draft is not target:
                draft.sessions -= 1
        if index >= self.measured_from:
            new = len(times)
            self.tally.ttft_ms.append(times[0] - arrival)
            if new > 1:
                self.tally.tpot_ms.append((times[-1] - times[0]) / (new - 1))

    def _draft_for(self, target: Device) -> Device | None:
        layout = self.cell.layout
        if layout is Layout.TARGET_ONLY:
            return None
        if layout is Layout.COLOCATED:
            return target
        return min(self.drafts, key=lambda d: d.sessions)

    def _generate(self, target: Device, draft: Device | None, rng: random.Random) -> Generator:
        """The request from admission to its last token; the times its tokens reached the
        draft worker (the client, less a constant)."""
        request = self.costs.request
        times: list[float] = []
        # 1. Prefill: the target's pass over the prompt gives the first token; the draft
        # reads the prompt meanwhile.
        yield from self._wait(self._delay())
        prefilled = target.verify(1, request.prompt_tokens)
        read = draft.read(request.prompt_tokens) if draft is not None else None
        yield prefilled
        yield from self._wait(self._delay())
        self._commit(times, 1)
        if read is not None:
            yield read
        # 2. Rounds.
        if draft is None:
            while len(times) < request.new_tokens:
                yield target.verify(1)
                self._commit(times, 1)
            return times
        policy = self.speculation.policy()
        policy.start_call(earlier=draft.handed_on)
        learns = isinstance(policy, AdaptiveK)  # a fixed k decides on nothing it measures
        while len(times) < request.new_tokens:
            room = request.new_tokens - len(times)
            action = policy.next_action(room)
            if action.stretch:
                yield from self._stretch(target, draft, policy, min(action.stretch, room), times)
            else:
                k = min(action.k, room - 1)
                yield from self._round(target, draft, policy, learns, k, rng, times)
        handed_on = policy.end_call()
        draft.handed_on = handed_on if handed_on is not None else draft.handed_on
        return times

    def _round(self, target, draft, policy, learns, k, rng, times) -> Generator:
        start = self.env.now
        # 1. Draft k tokens.
        if k:
            yield draft.draft(k)
            if learns:
                policy.observe_turn(proposed=True)
        drafted = self.env.now
        # 2. Send; 3. verify in one batched pass; 4. accept; 5. return.
        yield from self._wait(self._delay())
        verified: _Pass = yield target.verify(k + 1)
        accepted = _accepted(self.acceptance, k, rng)
        yield from self._wait(self._delay() + self.costs.link.round_overhead_ms)
        committed = min(accepted + 1, self.costs.request.new_tokens - len(times))
        self._commit(times, committed)
        self.tally.rounds += 1
        self.tally.round_tokens += committed
        self.tally.drafted += k
        if learns:
            stats = RoundStats(
                index=self.tally.rounds,
                base_len=self.costs.request.prompt_tokens + len(times) - committed,
                num_drafted=k,
                num_accepted=accepted,
                num_committed=committed,
                next_token_kind=NextTokenKind.BONUS if accepted == k else NextTokenKind.RECOVERED,
                draft_ns=int((drafted - start) * NS_PER_MS),
                verify_ns=int((self.env.now - drafted) * NS_PER_MS),
                target_compute_ns=int(verified.ms * NS_PER_MS),
                step=verified.load,
            )
            policy.observe_round(stats, int((self.env.now - start) * NS_PER_MS))

    def _stretch(self, target, draft, policy, tokens, times) -> Generator:
        """The target decodes `tokens` alone, each streamed back one way; then the draft
        reads them. Observed as speculative/stretches.py observes a stretch."""
        start = self.env.now
        yield from self._wait(self._delay())
        arrivals, passes = [], []
        for _ in range(tokens):
            done: _Pass = yield target.verify(1)
            arrivals.append(max(self.env.now + self._delay(), arrivals[-1] if arrivals else 0.0))
            passes.append(done)
        yield from self._wait(arrivals[-1] - self.env.now)
        intervals = [b - a for a, b in zip([start, *arrivals], arrivals)]
        for at_ms, done, interval in zip(arrivals, passes, intervals):
            self._commit(times, 1, at_ms)
            self.tally.stretch_tokens += 1
            stats = RoundStats(
                index=self.tally.rounds,
                base_len=self.costs.request.prompt_tokens + len(times) - 1,
                num_drafted=0,
                num_accepted=0,
                num_committed=1,
                next_token_kind=NextTokenKind.BONUS,
                draft_ns=0,
                verify_ns=int(interval * NS_PER_MS),
                target_compute_ns=int(done.ms * NS_PER_MS),
                streamed=True,
                step=done.load,
            )
            policy.observe_round(stats, int(interval * NS_PER_MS))
        solo = intervals[1:]
        if len(times) >= self.costs.request.new_tokens:  # the call ended inside it
            if solo:
                policy.observe_solo_tokens(len(solo), int(statistics.fmean(solo) * NS_PER_MS))
            return
        yield draft.read(tokens)
        token_ms = statistics.fmean(solo) if solo else intervals[0]
        policy.observe_stretch(
            len(solo) + 1,
            int((self.env.now - start) * NS_PER_MS),
            int(token_ms * NS_PER_MS),
            passes_ns=int((token_ms + sum(solo)) * NS_PER_MS),
        )

    # --- bookkeeping ------------------------------------------------------------------

    def _wait(self, ms: float) -> Generator:
        """Waits ms, where above 0: a session with nothing to wait for sends its next work
        in the same instant, in time for the device's next pass."""
        if ms > 0:
            yield self.env.timeout(ms)

    def _delay(self) -> float:
        delays = self.delays
        return delays[0] if len(delays) == 1 else self.link_random.choice(delays)

    def _commit(self, times: list[float], count: int, at_ms: float | None = None) -> None:
        at_ms = self.env.now if at_ms is None else at_ms
        times.extend([at_ms] * count)
        self.tally.commits.append((at_ms, count))

    def _result(self, rate_per_s: float | None) -> Result:
        tally, targets = self.tally, len(self.targets)
        window = max(tally.window[1] - tally.window[0], 1e-9)
        if rate_per_s is not None:  # overloaded, the queue only grows
            tally.queue(min(self.env.now, tally.window[1]), 0)
        elapsed = max(self.env.now, 1e-9)
        tokens_per_s = tally.tokens_per_ms() * 1000.0 / targets
        return Result(
            rate_per_s=(
                rate_per_s
                if rate_per_s is not None
                else tokens_per_s / self.costs.request.new_tokens
            ),
            tokens_per_s=tokens_per_s,
            tpot_p50_ms=_percentile(tally.tpot_ms, 50),
            tpot_p90_ms=_percentile(tally.tpot_ms, 90),
            ttft_p90_ms=_percentile(tally.ttft_ms, 90),
            mean_queue=tally.queue_area / window / targets if rate_per_s is not None else math.inf,
            tokens_per_round=tally.round_tokens / tally.rounds if tally.rounds else 1.0,
            drafted_per_round=tally.drafted / tally.rounds if tally.rounds else 0.0,
            stretch_share=tally.stretch_tokens / max(1, tally.round_tokens + tally.stretch_tokens),
            target_busy=sum(d.busy_ms for d in self.targets) / elapsed / targets,
            draft_busy=(
                sum(d.busy_ms for d in self.drafts) / elapsed / len(self.drafts)
                if self.drafts
                else 0.0
            ),
            requests=len(tally.tpot_ms),
            busy_tokens_per_s=self._busy_tokens_per_s(),
        )

    def _busy_tokens_per_s(self) -> float:
        commits = self.tally.commits
        if not commits:
            return 0.0
        span_ms = max(at_ms for at_ms, _ in commits) - self.first_arrival_ms
        return sum(n for _, n in commits) * 1000.0 / max(span_ms, 1e-9) / len(self.targets)


def simulate(
    costs: Costs,
    cell: Cell,
    speculation: Speculation,
    rate_per_s: float,
    *,
    workload: str | None = None,
    requests: int = 200,
    warmup: float = 0.2,
    seed: int = 0,
) -> Result:
    """`requests` Poisson arrivals at rate_per_s a target (the cell's share: rate_per_s
    x targets), the first `warmup` share left out of the measures."""
    arrivals = poisson_arrivals(rate_per_s * cell.targets, requests, seed)
    sim = Simulation(costs, cell, speculation, costs.acceptance(workload), seed)
    return sim.run(arrivals, int(warmup * requests), rate_per_s)


def saturate(
    costs: Costs,
    cell: Cell,
    speculation: Speculation,
    *,
    workload: str | None = None,
    seed: int = 0,
    near: float | None = None,
) -> Result:
    """The saturation rate (requests a second a target; past it the queue grows without
    bound) and what the cell serves there. First a rough capacity, every request at once
    (the sessions start in step, so a remote pool idles by turns; `near`: a rate known to
    be close, instead), then Poisson arrivals above it, measured while every slot is
    taken (arrivals spread the sessions' rounds, as in service). Its TPOT is that of full
    batches; its TTFT and queue grow with the run."""
    slots = costs.target.max_sessions * cell.targets
    acceptance = costs.acceptance(workload)
    rate = near
    if rate is None:
        rough = Simulation(costs, cell, speculation, acceptance, seed)
        rate = rough.run([0.0] * (slots + 1), 0, None).rate_per_s
    for _ in range(3):  # until the offered rate is above what the cell serves
        rate *= 1.5
        arrivals = poisson_arrivals(rate * cell.targets, 2 * slots, seed)
        result = Simulation(costs, cell, speculation, acceptance, seed).run(arrivals, 0, None)
        if result.rate_per_s < 0.9 * rate:
            return result
    return result


def poisson_arrivals(rate_per_s: float, count: int, seed: int) -> list[float]:
    """Arrival times in ms of a Poisson process (seeded)."""
    rng, now, times = random.Random(f"arrivals:{seed}"), 0.0, []
    for _ in range(count):
        now += rng.expovariate(rate_per_s / 1000.0)
        times.append(now)
    return times


def _accepted(acceptance: Acceptance, k: int, rng: random.Random) -> int:
    """Draft tokens accepted of k: each position i drawn against a_i until the first miss."""
    for i in range(k):
        if rng.random() >= acceptance.by_position[min(i, acceptance.k_max - 1)]:
            return i
    return k


def _percentile(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]
