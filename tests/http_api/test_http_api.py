"""The OpenAI-compatible HTTP API, through the real `openai` package, against the system
started as processes (target, draft, orchestrator, http_api) with tiny fp32 models.

Target: tiny-random:1. The draft worker's "model" drafter is the same model (every draft
token accepted: accepted and bonus tokens); its "ngram" drafter proposes where the text
repeats (rejections: recovered tokens); k = 0 is the target alone. Greedy outputs are
compared with the in-process target-only reference.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from specdec.v1 import common_pb2, orchestrator_pb2, target_pb2_grpc
from speculative.generator import SpeculativeGenerator
from speculative.sampling import SamplingParams
from tests.local_system import LocalSystem

MODEL = "tiny-random:1"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def system():
    with LocalSystem(draft_model=MODEL, http_port=0) as local:
        yield local


@pytest.fixture(scope="module")
def client(system) -> openai.OpenAI:
    # No retries: each error must reach the test as the server sent it.
    return openai.OpenAI(
        base_url=system.http_url + "/v1", api_key="unused", max_retries=0, timeout=60
    )


def _chat_ids(tokenizer, messages) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def _reference(tiny_target, ids, max_tokens=MAX_TOKENS) -> list[int]:
    """Target-only greedy; the orchestrator always stops at the end-of-text token."""
    params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=(tiny_target.eos_token_id,))
    return SpeculativeGenerator(tiny_target).generate(ids, params, k=0).token_ids


def _text(tiny_target, ids) -> str:
    return tiny_target.tokenizer.decode(ids, skip_special_tokens=True)


USER = [{"role": "user", "content": "abcabcabc: say it again"}]


def _chat(client, messages=USER, **kwargs):
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=kwargs.pop("max_tokens", MAX_TOKENS),
        **kwargs,
    )


def _stream(client, messages=USER, **kwargs) -> list:
    return list(_chat(client, messages, stream=True, **kwargs))


def _streamed_text(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_models_list(client):
    assert [m.id for m in client.models.list()] == [MODEL]


@pytest.mark.parametrize(("k", "drafter"), [(0, ""), (4, "model"), (3, "ngram")])
def test_greedy_chat_equals_target_only(client, tiny_target, k, drafter):
    reference = _reference(tiny_target, _chat_ids(tiny_target.tokenizer, USER))
    response = _chat(client, extra_body={"num_speculative_tokens": k, "drafter": drafter})
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == _text(tiny_target, reference)
    assert choice.finish_reason == ("length" if len(reference) == MAX_TOKENS else "stop")
    prompt_tokens = len(_chat_ids(tiny_target.tokenizer, USER))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (
        prompt_tokens,
        len(reference),
    )
    assert response.usage.total_tokens == prompt_tokens + len(reference)
    speculation = response.model_extra["speculation"]
    assert speculation["num_speculative_tokens"] == k
    assert sum(speculation["token_sources"].values()) == len(reference)
    if k == 0:
        assert (
            speculation["token_sources"]["target"] == len(reference)
            and speculation["drafted_tokens"] == 0
        )
    if drafter == "model":  # the draft is the target: every draft token accepted
        assert (
            speculation["acceptance_rate"] == 1.0 and speculation["token_sources"]["recovered"] == 0
        )
        assert speculation["token_sources"]["accepted"] == speculation["accepted_tokens"] > 0


def test_greedy_completion_equals_target_only(client, tiny_target):
    prompt = "to be or not to be, to be or not"
    reference = _reference(tiny_target, tiny_target.tokenizer(prompt).input_ids)
    response = client.completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"num_speculative_tokens": 4, "drafter": "ngram"},
    )
    assert response.object == "text_completion"
    assert response.choices[0].text == _text(tiny_target, reference)
    assert response.usage.completion_tokens == len(reference)
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == response.choices[0].text


def test_streamed_chat_equals_the_whole_one(client):
    whole = _chat(client, extra_body={"drafter": "model"})
    chunks = _stream(client, extra_body={"drafter": "model"})
    assert chunks[0].choices[0].delta.role == "assistant"
    assert _streamed_text(chunks) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk
    assert chunks[-1].model_extra["speculation"]["accepted_tokens"] > 0
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_include_usage_adds_a_last_chunk_without_choices(client, tiny_target):
    chunks = _stream(client, stream_options={"include_usage": True})
    *content, usage = chunks
    assert usage.choices == [] and usage.usage is not None
    assert all(c.usage is None for c in content)
    reference = _reference(tiny_target, _chat_ids(tiny_target.tokenizer, USER))
    assert usage.usage.completion_tokens == len(reference)
    assert usage.usage.prompt_tokens == len(_chat_ids(tiny_target.tokenizer, USER))


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_the_output_before_them(client, tiny_target, stream):
    text = _text(tiny_target, _reference(tiny_target, _chat_ids(tiny_target.tokenizer, USER)))
    # Two printable characters (a random model writes random bytes; a U+FFFD of a
    # character not yet complete must not be what the test stops at).
    stop = next(
        text[i : i + 2]
        for i in range(1, len(text) - 1)
        if text[i : i + 2].isprintable()
        and text[i : i + 2].isascii()
        and text[i : i + 2] not in text[: i + 1]
    )
    kwargs = {"stop": [stop, "never appears"], "extra_body": {"drafter": "model"}}
    if stream:
        chunks = _stream(client, **kwargs)
        output, finish = _streamed_text(chunks), chunks[-1].choices[0].finish_reason
    else:
        response = _chat(client, **kwargs)
        output, finish = response.choices[0].message.content, response.choices[0].finish_reason
    assert output == text[: text.find(stop)] and stop not in output
    assert finish == "stop"
    single = _chat(client, stop=stop)  # a string, not a list
    assert single.choices[0].message.content == text[: text.find(stop)]


def test_max_tokens_reached_is_length(client):
    for limit in ({"max_tokens": 5}, {"max_completion_tokens": 5, "max_tokens": None}):
        response = client.chat.completions.create(
            model=MODEL, messages=USER, temperature=0, **limit
        )
        assert response.choices[0].finish_reason == "length"
        assert response.usage.completion_tokens == 5


def test_seeded_sampling_reproduces(client):
    def run(seed: int) -> str:
        response = client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=32,
            temperature=0.9,
            top_p=0.95,
            seed=seed,
            extra_body={"num_speculative_tokens": 3, "drafter": "model"},
        )
        return response.choices[0].message.content

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_token_sources_show_how_each_token_was_produced(client):
    # The self-draft's last round may be the target's plain step, when proposals drafted
    # ahead (ending where their verdict comes) left it one token of room.
    for k, drafter, expected, last in (
        (4, "model", {"accepted", "bonus"}, ("bonus", "target")),
        (0, "", {"target"}, ("target",)),
    ):
        chunks = _stream(
            client,
            extra_body={
                "num_speculative_tokens": k,
                "drafter": drafter,
                "return_token_sources": True,
            },
        )
        tokens = [t for c in chunks for t in c.model_extra.get("token_sources", [])]
        assert "".join(t["text"] for t in tokens) == _streamed_text(chunks)
        sources = {t["source"] for t in tokens[:-1]}
        assert sources == expected, sources
        assert tokens[-1]["source"] in last
        speculation = chunks[-1].model_extra["speculation"]
        assert speculation["token_sources"] == {
            s: sum(t["source"] == s for t in tokens)
            for s in ("accepted", "recovered", "bonus", "target")
        }
        drafted = sum(c.model_extra.get("drafted_tokens", 0) for c in chunks)
        assert drafted == speculation["drafted_tokens"]


def test_a_continued_conversation_reuses_the_cached_prefix(client, tiny_target):
    first = _chat(client, extra_body={"drafter": "model"})
    history = [
        *USER,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "and once more"},
    ]
    second = _chat(client, history, extra_body={"drafter": "model"})
    full = _chat_ids(tiny_target.tokenizer, history)
    assert second.usage.prompt_tokens == len(full)
    # The first turn's prompt stayed cached: only what follows was prefilled (from where
    # the re-rendered reply first differs from its tokens; a random model's bytes do not
    # survive decoding and encoding again)...
    assert (
        second.model_extra["speculation"]["prefill_tokens"] <= len(full) - first.usage.prompt_tokens
    )
    # ...and the output is a fresh request's.
    assert second.choices[0].message.content == _text(tiny_target, _reference(tiny_target, full))
    # Another history (the same first message, another reply) is a fresh session.
    other = [
        *USER,
        {"role": "assistant", "content": "something else"},
        {"role": "user", "content": "and once more"},
    ]
    third = _chat(client, other)
    assert third.model_extra["speculation"]["prefill_tokens"] == third.usage.prompt_tokens


# ---------------------------------------------------------------- errors


def test_bad_json_is_400(client, system):
    with pytest.raises(openai.BadRequestError) as raised:
        client.post(
            "/chat/completions",
            cast_to=object,
            content=b'{"model": "tiny',
            options={"headers": {"Content-Type": "application/json"}},
        )
    assert raised.value.status_code == 400 and "not valid JSON" in raised.value.message
    request = urllib.request.Request(
        system.http_url + "/v1/completions", data=b"[1, 2", method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(request, timeout=30)
    error = json.loads(raw.value.read())["error"]
    assert raw.value.code == 400 and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("kwargs", "error_class", "status", "param", "message"),
    [
        ({"model": "gpt-4o"}, openai.NotFoundError, 404, "model", "does not exist"),
        ({"n": 2}, openai.BadRequestError, 400, "n", "only n=1"),
        (
            {"temperature": 5},
            openai.BadRequestError,
            400,
            "temperature",
            "'temperature' must be in [0, 2]",
        ),
        (
            {"temperature": -0.5},
            openai.BadRequestError,
            400,
            "temperature",
            "'temperature' must be in [0, 2]",
        ),
        ({"top_p": 0}, openai.BadRequestError, 400, "top_p", "'top_p' must be in (0, 1]"),
        (
            {"max_tokens": 0},
            openai.BadRequestError,
            400,
            "max_tokens",
            "'max_tokens' must be in [1, 2147483647], got 0",
        ),
        (
            {"messages": [{"role": "user", "content": "x" * 2000}]},
            openai.BadRequestError,
            400,
            None,
            "prompt of 2024 tokens does not fit the model's context length of 1024",
        ),
        (
            {"max_tokens": 1000},
            openai.BadRequestError,
            400,
            None,
            "above the room left in the context",
        ),
        (
            {"messages": [{"role": "tool", "content": "x"}]},
            openai.BadRequestError,
            400,
            "messages[0].role",
            "role",
        ),
        ({"logprobs": True}, openai.BadRequestError, 400, "logprobs", "not supported"),
        (
            {"extra_body": {"num_speculative_tokens": -1}},
            openai.BadRequestError,
            400,
            "num_speculative_tokens",
            "must be",
        ),
        ({"extra_body": {"drafter": "magic"}}, openai.BadRequestError, 400, None, "magic"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_errors_have_the_status_and_class_of_openai(
    client, kwargs, error_class, status, param, message, stream
):
    request = {"model": MODEL, "messages": USER, "temperature": 0, "max_tokens": 8, **kwargs}
    with pytest.raises(error_class) as raised:
        client.chat.completions.create(**request, stream=stream)
    error = raised.value
    assert error.status_code == status
    assert message in error.message
    assert error.body["type"] and error.body["param"] == param


def test_a_client_that_disconnects_frees_its_session(system):
    # Asked of the target itself: the orchestrator's view of its load is a snapshot that
    # lags by up to its refresh period (a stale "before" made this test flaky under load).
    workers = system.stub.ListWorkers(orchestrator_pb2.ListWorkersRequest()).workers
    targets = [
        target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(w.address))
        for w in workers
        if w.pool == common_pb2.WORKER_POOL_TARGET
    ]

    def target_sessions() -> int:
        return sum(
            t.Info(common_pb2.InfoRequest(), timeout=10).load.active_sessions for t in targets
        )

    before = target_sessions()
    body = json.dumps(
        {
            "model": MODEL,
            "messages": USER,
            "max_tokens": 900,
            "temperature": 0,
            "stream": True,
            "num_speculative_tokens": 1,
            "drafter": "ngram",
        }
    ).encode()
    request = urllib.request.Request(
        system.http_url + "/v1/chat/completions",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    reply = urllib.request.urlopen(request, timeout=30)
    assert reply.readline().startswith(b"data: ")  # streaming has begun
    reply.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 15
    while target_sessions() != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert target_sessions() == before


def test_health_and_playground(system):
    with urllib.request.urlopen(system.http_url + "/health", timeout=10) as reply:
        assert json.loads(reply.read()) == {"status": "ok", "orchestrator": "SERVING"}
    with urllib.request.urlopen(system.http_url + "/health/live", timeout=10) as reply:
        assert reply.status == 200
    with urllib.request.urlopen(system.http_url + "/", timeout=10) as reply:
        page = reply.read().decode()
    assert reply.headers["Content-Type"].startswith("text/html") and "/v1/chat/completions" in page
