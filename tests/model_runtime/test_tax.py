"""What target-only decoding pays beyond its passes: no pass for the first token after
a prefill, and no wait for gRPC's send between the tokens of a stream."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from model_runtime.batched_forward import forward_segments
from model_runtime.model_session import ModelSession
from model_runtime.step_scheduler import StepScheduler
from service_common.server import read_ahead
from speculative.sampling import SamplingParams
from speculative.target import TargetSession
from tests.polling import holds_for

LOGIT_TOLERANCE = 1e-4  # one row's fp32 logits in a pass of other rows: summation order only


def _full_logits(loaded, token_ids) -> torch.Tensor:
    with torch.inference_mode():
        return loaded.model(input_ids=torch.tensor([token_ids])).logits[0]


def test_the_first_logits_after_a_prefill_need_no_pass(tiny_target, prompt_ids):
    ids = prompt_ids[0]
    session = ModelSession(tiny_target.model, tiny_target.context_length)
    session.append(ids)
    session.prefill()
    assert session.cached_length == len(ids) - 1  # the last token stays pending
    passes = session.num_forward_passes
    logits = session.logits(1)
    assert session.num_forward_passes == passes and session.cached_length == len(ids)
    torch.testing.assert_close(
        logits[0], _full_logits(tiny_target, ids)[-1], rtol=LOGIT_TOLERANCE, atol=LOGIT_TOLERANCE
    )
    session.append([7])
    torch.testing.assert_close(
        session.logits(1)[0],
        _full_logits(tiny_target, [*ids, 7])[-1],
        rtol=LOGIT_TOLERANCE,
        atol=LOGIT_TOLERANCE,
    )  # the kept keys and values serve on


@pytest.mark.parametrize("change", ["replace the last token", "draft two tokens", "release"])
def test_kept_logits_never_outlive_their_token(tiny_target, prompt_ids, change):
    ids = prompt_ids[1]
    session = ModelSession(tiny_target.model, tiny_target.context_length)
    session.append(ids)
    session.prefill()
    if change == "replace the last token":
        session.truncate_to(len(ids) - 1)
        session.append([5])
        expected, positions = _full_logits(tiny_target, [*ids[:-1], 5])[-1:], 1
    elif change == "draft two tokens":
        session.append([5, 6])
        expected, positions = _full_logits(tiny_target, [*ids, 5, 6])[-3:], 3
    else:
        session.release()
        expected, positions = _full_logits(tiny_target, ids)[-1:], 1
    passes = session.num_forward_passes
    torch.testing.assert_close(
        session.logits(positions), expected, rtol=LOGIT_TOLERANCE, atol=LOGIT_TOLERANCE
    )
    assert session.num_forward_passes == passes + 1
    if change == "draft two tokens":  # the pass re-ran the last prompt token: nothing kept after it
        session.truncate_to(len(ids))
        session.logits(1)
        assert session.num_forward_passes == passes + 2


def test_a_prefill_cut_into_chunks_keeps_the_last_chunks_logits(tiny_target, prompt_ids):
    """A prefill cut into chunks (as a scheduler cuts it to its budget): only the chunk
    with the last token gives its logits; the first decode step then runs no pass, and
    a step that ran none does not enter the fitted step cost."""
    ids = prompt_ids[19]
    target = TargetSession(tiny_target, ids, SamplingParams(max_new_tokens=8), prefill=False)
    steps, chunks = target.prefill_steps(), 0
    try:
        segment = next(steps)
        while True:
            segment.trim(min(7, segment.num_tokens))
            chunks += 1
            segment = steps.send((forward_segments(tiny_target.model, [segment])[0], 0))
    except StopIteration:
        pass
    assert chunks == -(-len(ids) // 7) and target.session.cached_length == len(ids) - 1
    scheduler = StepScheduler(tiny_target.model)
    try:
        scheduler.run(lambda: None)
        passes, recent = target.session.num_forward_passes, list(scheduler._recent)
        result, load = scheduler.submit(target.verify_steps(len(ids), []))
        assert target.session.num_forward_passes == passes and list(scheduler._recent) == recent
        assert load.batch_tokens == 1  # the step reports the token it answered
        batched = [result.token_ids[0]]
        for _ in range(7):
            batched.append(scheduler.submit(target.verify_steps(target.length, []))[0].token_ids[0])
    finally:
        scheduler.stop()
    unchunked = TargetSession(
        tiny_target, ids, SamplingParams(max_new_tokens=8)
    )  # prefilled in one pass
    assert batched == [r.token_ids[0] for r in unchunked.decode(len(ids), 8)]


class _Context:
    def __init__(self):
        self.active = True

    def is_active(self) -> bool:
        return self.active


def test_read_ahead_computes_the_next_message_while_the_last_is_sent():
    produced = []

    def handler(request, context):
        for index in range(request):
            produced.append(index)
            yield index

    stream = read_ahead(handler)(5, _Context())
    assert next(stream) == 0
    deadline = time.monotonic() + 5
    while len(produced) < 2 and time.monotonic() < deadline:  # gRPC "sends" message 0 meanwhile
        time.sleep(0.01)
    # message 1 is ready, at most one more computed: backpressure
    holds_for(lambda: len(produced) in (2, 3), "at most one message computed ahead", duration_s=0.1)
    assert list(stream) == [1, 2, 3, 4]


def test_read_ahead_raises_the_handlers_error_on_the_callers_thread():
    def handler(request, context):
        yield "first"
        raise ValueError("refused")

    stream = read_ahead(handler)(None, _Context())
    assert next(stream) == "first"
    with pytest.raises(ValueError, match="refused"):
        next(stream)


def test_a_cancelled_read_ahead_stream_stops_and_cleans_up_its_handler():
    cleaned, produced = threading.Event(), []

    def handler(request, context):
        try:
            for index in range(1000):
                produced.append(index)
                yield index
        finally:
            cleaned.set()

    context = _Context()
    stream = read_ahead(handler)(None, context)
    next(stream)
    context.active = False  # the client cancelled
    stream.close()  # gRPC drops the stream
    assert cleaned.wait(5)
    assert len(produced) <= 3


def test_a_read_ahead_stream_cancelled_while_computing_ends_for_grpc_too():
    """The producer stops without a message (the call went inactive while it
    computed): gRPC's thread, waiting for the next message, is let go."""
    context = _Context()

    def handler(request, context_):
        yield "first"
        context.active = False  # cancelled while the second message is computed
        yield "second"

    stream = read_ahead(handler)(None, context)
    assert next(stream) == "first"
    assert list(stream) in ([], ["second"])
