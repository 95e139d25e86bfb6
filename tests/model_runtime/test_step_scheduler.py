"""Batched forward passes and the step scheduler against the unbatched path.

The contract: batching changes which pass computes a session's tokens, never what the
session decides. Greedy tokens are equal exactly, logits within float rounding (the
bound is asserted and printed), and a seeded sampling session draws the same tokens
whatever shares its steps.
"""

from __future__ import annotations

import threading

import pytest
import torch

from foundation.errors import StaleProposal
from model_runtime.batched_forward import Segment, SequenceKV, forward_segments
from model_runtime.model_session import ModelSession
from model_runtime.step_scheduler import StepScheduler, fit_step_cost
from speculative.sampling import SamplingParams, SparseProbs
from speculative.target import TargetSession

GREEDY = SamplingParams(max_new_tokens=64)
# fp32 logits of one row computed in a pass of other rows differ from the row alone by
# summation order only (the linears' blocking changes with the row count).
LOGIT_TOLERANCE = 1e-4


def _ids(text: str) -> list[int]:
    return list(text.encode())


def _alone_logits(model, prompt: list[int], new: list[int]) -> torch.Tensor:
    session = ModelSession(model, 1024)
    session.append(prompt)
    session.prefill()
    session.append(new)
    return session.logits(len(new) + 1)


def test_batched_pass_equals_each_sequence_alone(tiny_target):
    model = tiny_target.model
    prompts = [
        _ids(p)
        for p in (
            "The quick brown fox",
            "def f(x):\n  return",
            "z",
            "abcabcabcabcabcabc",
            "1, 2, 3,",
        )
    ]
    drafts = [[1, 2, 3, 4], [], [7], [97, 98, 99], [50] * 8]  # k of 4, 0, 1, 3, 8
    kvs = [SequenceKV() for _ in prompts]
    forward_segments(
        model, [Segment(kv, 0, p[:-1], 0) for kv, p in zip(kvs, prompts) if len(p) > 1]
    )
    segments = [
        Segment(kv, len(p) - 1, [p[-1], *d], len(d) + 1) for kv, p, d in zip(kvs, prompts, drafts)
    ]
    batched = forward_segments(model, segments)
    worst = 0.0
    for prompt, draft, logits in zip(prompts, drafts, batched):
        alone = _alone_logits(model, prompt, draft)
        assert logits.shape == alone.shape == (len(draft) + 1, tiny_target.vocab_size)
        assert torch.equal(logits.argmax(-1), alone.argmax(-1))
        worst = max(worst, float((logits - alone).abs().max()))
    print(f"largest logit difference batched vs alone: {worst:.2e}")
    assert worst <= LOGIT_TOLERANCE


def test_a_wide_step_runs_padded_and_each_row_stays_its_own(tiny_target):
    """A step wider than EXACT_ROWS runs at padded_rows' width (fewer widths for
    oneDNN to build kernels for): the padding rows touch no cache and give no logits,
    and every segment's logits and cache equal those of the step run unpadded."""
    import model_runtime.batched_forward as batched_forward

    model = tiny_target.model
    prompts = [
        [(7 * i + j) % 250 for i in range(n)] for j, n in enumerate((70, 3, 9))
    ]  # 82 rows: 88 padded
    assert batched_forward.padded_rows(82) == 88

    def run(exact_rows: int) -> tuple[list[torch.Tensor], list[SequenceKV]]:
        batched_forward.EXACT_ROWS = exact_rows
        kvs = [SequenceKV() for _ in prompts]
        logits = forward_segments(model, [Segment(kv, 0, p, 2) for kv, p in zip(kvs, prompts)])
        return logits, kvs

    seen_rows = []  # rows each attention call saw, per run
    original = batched_forward._ragged_attention

    def spy(module, query, *args, **kwargs):
        seen_rows[-1].add(query.shape[2])
        return original(module, query, *args, **kwargs)

    batched_forward.AttentionInterface.register(batched_forward.RAGGED_ATTENTION, spy)
    try:
        seen_rows.append(set())
        padded, padded_kvs = run(64)
        seen_rows.append(set())
        exact, exact_kvs = run(10_000)
    finally:
        batched_forward.EXACT_ROWS = 64
        batched_forward.AttentionInterface.register(batched_forward.RAGGED_ATTENTION, original)
    assert seen_rows == [{88}, {82}]
    for a, b in zip(padded, exact):
        assert a.shape == b.shape == (2, tiny_target.vocab_size)
        assert (
            torch.equal(a.argmax(-1), b.argmax(-1))
            and float((a - b).abs().max()) <= LOGIT_TOLERANCE
        )
    # each cache holds its own rows, no more
    for prompt, kv_a, kv_b in zip(prompts, padded_kvs, exact_kvs):
        for store_a, store_b in ((kv_a._keys, kv_b._keys), (kv_a._values, kv_b._values)):
            for layer in store_b:
                a, b = store_a[layer][:, : len(prompt)], store_b[layer][:, : len(prompt)]
                assert float((a - b).abs().max()) <= LOGIT_TOLERANCE


def test_cache_grows_past_its_first_allocation(tiny_target):
    prompt = [i % 250 for i in range(700)]  # past the first 256-token allocation, twice
    kv = SequenceKV()
    for start in range(0, 699, 100):  # prefill in uneven chunks
        chunk = prompt[start : min(start + 100, 699)]
        forward_segments(tiny_target.model, [Segment(kv, start, chunk, 0)])
    logits = forward_segments(tiny_target.model, [Segment(kv, 699, prompt[699:], 1)])[0]
    assert kv.capacity() >= 700
    reference = ModelSession(tiny_target.model, 1024)
    reference.append(prompt)
    assert torch.allclose(logits, reference.logits(1), atol=LOGIT_TOLERANCE)


def _greedy_alone(loaded, prompt: list[int], num_tokens: int) -> list[int]:
    target = TargetSession(loaded, prompt, GREEDY)
    return [r.token_ids[0] for r in target.decode(len(prompt), num_tokens)]


def _speculate_batched(
    scheduler: StepScheduler,
    loaded,
    prompt: list[int],
    num_tokens: int,
    drafts: list[list[int]],
    params: SamplingParams = GREEDY,
) -> list[int]:
    """Verifies scripted proposals (cycled) through the scheduler until num_tokens."""
    target = TargetSession(loaded, prompt, params, prefill=False)
    scheduler.submit(target.prefill_steps())
    out: list[int] = []
    round_index = 0
    while len(out) < num_tokens:
        draft = drafts[round_index % len(drafts)]
        round_index += 1
        result, load = scheduler.submit(target.verify_steps(target.length, draft))
        assert load is not None and load.batch_tokens >= len(draft) + 1
        out.extend(result.token_ids)
    return out[:num_tokens]


def _run_threads(functions) -> list:
    results = [None] * len(functions)
    errors = []

    def run(index, fn):
        try:
            results[index] = fn()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(functions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    return results


@pytest.mark.parametrize("max_batch_tokens", [512, 7])  # 7: prefills cut into chunks
def test_concurrent_sessions_equal_target_only_greedy(tiny_target, max_batch_tokens):
    """Sessions of different lengths, k and acceptance share steps; each one's greedy
    output equals target-only greedy token for token."""
    prompts = [
        _ids(p)
        for p in (
            "The quick brown fox jumps over the lazy dog.",
            "def add(a, b):\n",
            "z",
            "to be or not to be, to be or not",
            "SELECT name FROM users WHERE id = 42;",
            "red green blue red green blue red",
        )
    ]
    references = [_greedy_alone(tiny_target, p, 24) for p in prompts]
    # Per session: right drafts (the reference itself), wrong ones, none (k = 0), mixed.
    scripts = [
        [[t] for t in references[0]],
        [[1, 2, 3, 4]],
        [[]],
        [references[3][:3], [5, 5]],
        [[]],
        [[9] * 6, []],
    ]
    scheduler = StepScheduler(tiny_target.model, max_batch_tokens=max_batch_tokens)
    try:
        outputs = _run_threads(
            [
                (lambda p=p, s=s: _speculate_batched(scheduler, tiny_target, p, 24, s))
                for p, s in zip(prompts, scripts)
            ]
        )
    finally:
        scheduler.stop()
    assert outputs == references


def test_seeded_sampling_reproduces_whatever_shares_the_steps(tiny_target):
    """A seeded session draws the same tokens alone and batched with other sessions."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_new_tokens=64)
    prompt = _ids("Once upon a time, in a land far away,")
    drafts = [[_ids(" the")[0], 101], []]
    alone = StepScheduler(tiny_target.model)
    try:
        reference = _speculate_batched(alone, tiny_target, prompt, 20, drafts, params)
    finally:
        alone.stop()
    crowded = StepScheduler(tiny_target.model)
    others = [SamplingParams(temperature=0.8, seed=s, max_new_tokens=64) for s in range(5)]
    try:
        outputs = _run_threads(
            [lambda: _speculate_batched(crowded, tiny_target, prompt, 20, drafts, params)]
            + [
                (
                    lambda o=o: _speculate_batched(
                        crowded, tiny_target, _ids("Hello there"), 30, [[3, 4, 5]], o
                    )
                )
                for o in others
            ]
        )
    finally:
        crowded.stop()
    assert outputs[0] == reference


def _prefilled(scheduler: StepScheduler, loaded, text: str) -> tuple[list[int], TargetSession]:
    """A greedy target session on `text`, its prompt prefilled through the scheduler."""
    prompt = _ids(text)
    target = TargetSession(loaded, prompt, GREEDY, prefill=False)
    scheduler.submit(target.prefill_steps())
    return prompt, target


def test_a_failing_job_leaves_the_others_and_its_session_intact(tiny_target):
    scheduler = StepScheduler(tiny_target.model)
    try:
        prompt, target = _prefilled(scheduler, tiny_target, "The capital of France is")
        with pytest.raises(StaleProposal):  # refused before any pass: nothing applied
            scheduler.submit(target.verify_steps(target.length + 3, [1, 2]))
        assert target.length == len(prompt)
        result, _ = scheduler.submit(target.verify_steps(target.length, []))
        assert result.token_ids == _greedy_alone(tiny_target, prompt, 1)
    finally:
        scheduler.stop()


def test_a_failing_pass_rolls_every_job_of_the_step_back(tiny_target):
    """A forward pass that raises (e.g. out of memory) fails each job in it; each
    session is left at its committed length and serves the next call."""
    scheduler = StepScheduler(tiny_target.model)
    try:
        prompt, target = _prefilled(scheduler, tiny_target, "abcabcabc")
        scheduler.model = None  # the next pass raises inside the model call
        with pytest.raises(AttributeError):
            scheduler.submit(target.verify_steps(target.length, [1, 2, 3]))
        assert target.length == len(prompt)
        scheduler.model = tiny_target.model
        result, _ = scheduler.submit(target.verify_steps(target.length, []))
        assert result.token_ids == _greedy_alone(tiny_target, prompt, 1)
    finally:
        scheduler.stop()


def test_sampled_verification_with_draft_probs_batched(tiny_target):
    """Sparse draft distributions travel through the batched path unchanged: with the
    same seed, batched and alone verification commit the same tokens."""
    params = SamplingParams(temperature=1.0, seed=7, max_new_tokens=64)
    prompt = _ids("for (int i = 0; i < n; ++i) {")
    draft = [32, 105]
    probs = [
        SparseProbs(torch.tensor([32, 33]), torch.tensor([0.75, 0.25])),
        SparseProbs(torch.tensor([105]), torch.tensor([1.0])),
    ]
    alone = TargetSession(tiny_target, prompt, params)
    expected = alone.verify(len(prompt), draft, probs).token_ids
    scheduler = StepScheduler(tiny_target.model)
    try:
        target = TargetSession(tiny_target, prompt, params, prefill=False)
        scheduler.submit(target.prefill_steps())
        result, _ = scheduler.submit(target.verify_steps(len(prompt), draft, probs))
    finally:
        scheduler.stop()
    assert result.token_ids == expected


def test_draft_sessions_batched_propose_what_each_proposes_alone(tiny_target):
    """The draft worker's model drafter: sessions drafting at the same time share
    passes, and each proposes exactly what it proposes alone (greedy and seeded)."""
    from speculative.drafters import ModelDrafter

    drafter = ModelDrafter(tiny_target)
    prompts = [_ids(p) for p in ("def add(a, b):\n", "The quick brown", "z", "1, 2, 3,")]
    params = [
        GREEDY,
        SamplingParams(temperature=1.0, seed=3),
        GREEDY,
        SamplingParams(temperature=0.7, seed=9),
    ]
    ks = [4, 3, 1, 6]
    alone = [drafter.open(p, s).propose(k) for p, s, k in zip(prompts, params, ks)]
    scheduler = StepScheduler(tiny_target.model)
    try:
        sessions = [drafter.open(p, s) for p, s in zip(prompts, params)]
        batched = _run_threads(
            [
                (lambda d=d, k=k: scheduler.submit(d.propose_steps(k))[0])
                for d, k in zip(sessions, ks)
            ]
        )
    finally:
        scheduler.stop()
    assert [p.token_ids for p in batched] == [p.token_ids for p in alone]
    for a, b in zip(alone, batched):
        if a.draft_probs is not None:
            assert all(
                torch.equal(x.token_ids, y.token_ids) for x, y in zip(a.draft_probs, b.draft_probs)
            )


def test_each_job_decides_on_its_own_rows_of_the_batched_logits(tiny_target, monkeypatch):
    """Crafted logits: the batched pass is replaced by one whose logits name, for every
    position, a token derived from the session and the position. Each job's verdict must
    be verify_greedy on its own rows, whatever else ran in the step."""
    import model_runtime.step_scheduler as step_scheduler
    from speculative.rejection import verify_greedy

    vocab = tiny_target.vocab_size

    def crafted(
        segment: Segment,
    ) -> torch.Tensor:  # [num_logits, vocab]: argmax = (start + i + t0) % vocab
        logits = torch.zeros(segment.num_logits, vocab)
        first = segment.start + segment.num_tokens - segment.num_logits
        for i in range(segment.num_logits):
            logits[i, (first + i + segment.token_ids[0]) % vocab] = 1.0
        return logits

    steps_seen = []

    def fake_forward(model, segments):
        steps_seen.append(len(segments))
        return [crafted(s) for s in segments]

    monkeypatch.setattr(step_scheduler, "forward_segments", fake_forward)
    scheduler = StepScheduler(tiny_target.model)
    prompts = [_ids(p) for p in ("abc", "hello world", "xyz xyz", "0123456789")]
    try:
        sessions = [TargetSession(tiny_target, p, GREEDY) for p in prompts]  # prefilled alone
        proposals = [[5, 6, 7], [], [1], [9, 9, 9, 9, 9]]
        # Drafts right for their first token where the crafted argmax allows it.
        for session, draft in zip(sessions, proposals):
            if draft:
                draft[0] = (session.length - 1 + session.session.last_token_id) % vocab
        expected = []
        for session, draft in zip(sessions, proposals):
            segment = Segment(
                None, session.length - 1, [session.last_token_id, *draft], len(draft) + 1
            )
            expected.append(verify_greedy(draft, crafted(segment)))
        results = _run_threads(
            [
                (lambda s=s, d=d: scheduler.submit(s.verify_steps(s.length, d))[0])
                for s, d in zip(sessions, proposals)
            ]
        )
    finally:
        scheduler.stop()
    assert [r.verdict for r in results] == expected
    assert any(v.num_accepted >= 1 for v in expected)


def test_a_step_waits_only_for_callers_expected_back_within_its_window():
    from model_runtime.step_scheduler import _Turnarounds

    ms = 1_000_000
    turnarounds = _Turnarounds()
    for key, gap_ms in (("quick", 3), ("slow", 400)):  # one measured turn-around each
        turnarounds.left(key, 0)
        turnarounds.back(key, gap_ms * ms)
    turnarounds.left("quick", 1000 * ms)
    turnarounds.left("slow", 1000 * ms)
    # Window of 50 ms: wait for the quick caller (3 ms), never for the slow one (400 ms).
    assert turnarounds.wait_until(1050 * ms, 1000 * ms) == 1003 * ms
    turnarounds.left("new", 1000 * ms)  # no turn-around measured yet: the whole window
    assert turnarounds.wait_until(1050 * ms, 1000 * ms) == 1050 * ms
    turnarounds.back("new", 1001 * ms)
    # the quick one is late: no wait
    assert turnarounds.wait_until(1050 * ms, 1010 * ms) == 1010 * ms


def test_the_step_cost_tells_tokens_with_logits_from_prefill_tokens():
    """A token with logits (a decode step's, a draft's) runs the output layer and a
    decision; a prefill token does not: the fit prices one more draft token as the
    former, whatever prefill shares the steps."""
    ms = 1_000_000
    rows = [(logits, prefill) for logits in range(2, 18) for prefill in (0, 0, 40, 90)]
    steps = [
        (logits + prefill, logits, 50 * ms + 2 * ms * logits + ms // 2 * prefill)
        for logits, prefill in rows
    ]
    assert fit_step_cost(steps) == pytest.approx((50 * ms, 2 * ms, ms // 2), rel=1e-6)
    decode_only = [(logits, logits, 50 * ms + 2 * ms * logits) for logits in range(2, 18)]
    assert fit_step_cost(decode_only) == pytest.approx((50 * ms, 2 * ms, 0.0))
    # one size: its slope unknown
    assert fit_step_cost([(8, 8, 60 * ms)] * 4) == (
        60 * ms,
        0.0,
        0.0,
    )
    # One decode width beside prefills of different sizes: the prefill price, and the base without it.
    fixed_width = [(8 + prefill, 8, 60 * ms + ms * prefill) for prefill in (0, 0, 30, 100)]
    assert fit_step_cost(fixed_width) == pytest.approx((60 * ms, 0.0, ms))
    assert fit_step_cost([]) == (0.0, 0.0, 0.0)


def _waiting_job(token_ids: list[int], num_logits: int, fill: bool = False):
    from model_runtime.step_scheduler import _Job

    job = _Job(iter(()))
    job.segment = Segment(None, 0, token_ids, num_logits, fill)
    return job


def test_prefill_lengthens_a_step_with_decoding_sessions_by_at_most_its_share():
    """Stall-free batching: beside 8 decode steps (fitted at 30 + 5 each = 70 ms) a
    prompt's chunk may add a quarter of that (17.5 ms at 1 ms a prefill token); alone,
    or while the price of a prefill token is unknown, it takes the whole budget."""
    from foundation.pass_cost import PassCost

    ms = 1_000_000
    scheduler = StepScheduler(None, max_batch_tokens=512, prefill_share=0.25)
    try:
        decoding = [_waiting_job([7], 1) for _ in range(8)]
        prompts = [_waiting_job(list(range(200)), 1, fill=True), _waiting_job(list(range(50)), 0)]
        scheduler._jobs = [prompts[0], *decoding, prompts[1]]
        scheduler._cost = PassCost(30 * ms, 5 * ms, 1 * ms)
        picked = scheduler._pick()
        assert picked[:8] == decoding and picked[8] is prompts[0] and len(picked) == 9
        assert prompts[0].segment.num_tokens == 17 and prompts[0].segment.num_logits == 0

        scheduler._jobs = [
            _waiting_job([7], 1),
            _waiting_job(list(range(3)), 0),
            _waiting_job(list(range(40)), 0),
        ]
        # 35 ms of decoding: 8 prefill tokens over both prompts, oldest first
        picked = scheduler._pick()
        assert [job.segment.num_tokens for job in picked] == [1, 3, 5]

        alone = _waiting_job(list(range(200)), 1, fill=True)
        scheduler._jobs = [alone]
        assert scheduler._pick() == [alone] and alone.segment.num_tokens == 200

        scheduler._cost = PassCost(30 * ms, 5 * ms, 0.0)  # a prefill token's price not known yet
        unpriced = _waiting_job(list(range(200)), 1, fill=True)
        scheduler._jobs = [_waiting_job([7], 1), unpriced]
        assert len(scheduler._pick()) == 2 and unpriced.segment.num_tokens == 200
    finally:
        scheduler.stop()


def _decode_stream(target: TargetSession, num_tokens: int):
    """A streaming job: num_tokens tokens decoded alone, each emitted as it comes."""
    from model_runtime.model_session import Emit

    for _ in range(num_tokens):
        result = yield from target.verify_steps(target.length, [])
        yield Emit(result.token_ids[0])


def test_a_streaming_job_is_in_every_step_until_it_ends(tiny_target, monkeypatch):
    """Decode runs stay in the steps: from its first step to its last, a run is in every
    step, and a session doing rounds beside them (one job per round) changes none of
    their tokens."""
    import model_runtime.step_scheduler as step_scheduler

    steps = []  # per step, the caches its segments belong to
    real_forward = step_scheduler.forward_segments

    def recording_forward(model, segments):
        steps.append({id(segment.kv) for segment in segments})
        return real_forward(model, segments)

    monkeypatch.setattr(step_scheduler, "forward_segments", recording_forward)
    scheduler = StepScheduler(tiny_target.model)
    try:
        prompts = [_ids("The quick brown fox"), _ids("def add(a, b):\n"), _ids("to be or not")]
        targets = [TargetSession(tiny_target, p, GREEDY, prefill=False) for p in prompts[:2]]
        for target in targets:
            scheduler.submit(target.prefill_steps())
        steps.clear()
        lengths = (24, 12)

        def run(index):
            loads = list(
                scheduler.stream(_decode_stream(targets[index], lengths[index]), key=index)
            )
            assert all(load is not None and load.batch_sessions >= 1 for _, load in loads)
            return [token for token, _ in loads]

        results = _run_threads(
            [
                lambda: run(0),
                lambda: run(1),
                lambda: _speculate_batched(scheduler, tiny_target, prompts[2], 12, [[5, 6], []]),
            ]
        )
        for index, length in enumerate(lengths):
            assert results[index] == _greedy_alone(tiny_target, prompts[index], length)
            kv = id(targets[index].session._kv)
            in_step = [kv in step for step in steps]
            first, last = in_step.index(True), len(in_step) - 1 - in_step[::-1].index(True)
            assert all(in_step[first : last + 1]) and sum(in_step) == length
        assert results[2] == _greedy_alone(tiny_target, prompts[2], 12)
    finally:
        scheduler.stop()


def test_closing_a_stream_stops_its_job_and_rolls_its_pending_pass_back(tiny_target):
    scheduler = StepScheduler(tiny_target.model)
    try:
        prompt, target = _prefilled(scheduler, tiny_target, "abcabcabc")
        tokens = scheduler.stream(_decode_stream(target, 1000))
        first = [next(tokens)[0] for _ in range(3)]
        tokens.close()  # returns once the job left the steps
        length = target.length
        assert length >= len(prompt) + 3 and target.session.cached_length <= length
        result, _ = scheduler.submit(
            target.verify_steps(target.length, [])
        )  # the session serves on
        expected = _greedy_alone(tiny_target, prompt, length - len(prompt) + 1)
        assert first == expected[:3] and result.token_ids[0] == expected[-1]
    finally:
        scheduler.stop()
