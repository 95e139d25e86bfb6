"""orchestrator.tokenizer: the target's tokenizer, loaded at the first call, joins what
start-up froze out of the garbage collector's reach, where start-up froze it."""

import gc

from model_runtime.loading import TINY_PREFIX
from orchestrator.tokenizer import TargetTokenizer


def _walked_by_a_full_collection(obj) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_a_tokenizer_loaded_after_start_up_is_frozen_with_it():
    gc.freeze()  # as serve_until_signalled does
    try:
        tokenizer = TargetTokenizer(pool=None, name=TINY_PREFIX).get()
        assert not _walked_by_a_full_collection(tokenizer)
    finally:
        gc.unfreeze()  # this test process goes on creating and dropping models


def test_nothing_is_frozen_where_start_up_froze_nothing():
    assert gc.get_freeze_count() == 0
    tokenizer = TargetTokenizer(pool=None, name=TINY_PREFIX).get()
    assert gc.get_freeze_count() == 0
    assert _walked_by_a_full_collection(tokenizer)


# The tokenizer a target serves (GetTokenizer), rebuilt with the tokenizers library and
# Jinja: it answers as the transformers tokenizer the target holds.

import gzip  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from concurrent import futures  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import grpc  # noqa: E402
import jinja2  # noqa: E402
import pytest  # noqa: E402

from model_runtime import tiny  # noqa: E402
from model_runtime.fingerprint import tokenizer_fingerprint  # noqa: E402
from model_runtime.loading import load_tokenizer  # noqa: E402
from orchestrator.tokenizer import ServedTokenizer, load_tokenizer_override  # noqa: E402
from service_common.status import FailedPrecondition, Unavailable  # noqa: E402
from specdec.v1 import target_pb2_grpc  # noqa: E402
from target_service.served_tokenizer import served_tokenizer  # noqa: E402
from tests.conftest import PROMPTS  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    *PROMPTS,
    "héllo wörld ✓ 日本語",
    "<|im_start|>user\nhi<|im_end|>\n",
    "  two  spaces ",
    "",
    "<|endoftext|>x",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi ✓ <|im_end|> there"},
    ],
    [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ],
    [
        {"role": "system", "content": ""},
        {"role": "user", "content": "{{ not a template }} {% raw %}"},
    ],
]
# Every rule of transformers' environment a template may lean on.
RULES_TEMPLATE = """
{%- set ns = namespace(count=0) -%}
{{ bos_token }}{% for message in messages %}
  {%- if message['role'] == 'system' %}{% continue %}{% endif %}
  {%- set ns.count = ns.count + 1 %}
  [{{ ns.count }}] {{ message | tojson }} {{ message.content | tojson(indent=2, sort_keys=True) }}
  {% generation %}{{ message['content'] | upper }}{% endgeneration %}
  {%- if message.content == 'stop' %}{% break %}{% endif %}
{% endfor %}
{{ dict(a=1, b='<&>') | tojson(separators=(',', ':')) }} {{ 'extra' in messages[-1] }} {{ strftime_now('%Y') }}
{%- if add_generation_prompt %}{{ eos_token }}<|assistant|>{% endif %}"""


def _served(loaded) -> ServedTokenizer:
    return ServedTokenizer.from_served(served_tokenizer(loaded))


def _assert_same_tokenizer(served, reference) -> None:
    assert tokenizer_fingerprint(served) == tokenizer_fingerprint(reference)
    assert served.eos_token_id == reference.eos_token_id
    for text in TEXTS:
        for add_special_tokens in (True, False):
            assert (
                served(text, add_special_tokens=add_special_tokens).input_ids
                == reference(text, add_special_tokens=add_special_tokens).input_ids
            ), text
        ids = reference(text).input_ids
        for skip in (True, False):
            assert served.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip
            )
    for messages in CHATS:
        for add_generation_prompt in (True, False):
            assert served.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            ) == reference.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            assert served.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt
            ) == reference.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )


def test_the_served_tiny_tokenizer_answers_as_the_targets(tiny_target):
    _assert_same_tokenizer(_served(tiny_target), tiny_target.tokenizer)


def test_the_served_smollm2_tokenizer_and_template_answer_as_the_targets():
    reference = load_tokenizer("smollm2-135m")  # the real template, special tokens, 49,152 tokens
    loaded = SimpleNamespace(
        name="smollm2-135m", tokenizer=reference, fingerprint=tokenizer_fingerprint(reference)
    )
    served = _served(loaded)
    assert "<|im_start|>" in served.chat_template
    _assert_same_tokenizer(served, reference)


def test_chat_templates_render_with_transformers_rules():
    reference = tiny.byte_tokenizer()
    reference.chat_template = RULES_TEMPLATE
    reference.add_special_tokens({"bos_token": "<s>"})
    served = ServedTokenizer(
        reference.backend_tokenizer.to_str(), RULES_TEMPLATE, reference.special_tokens_map
    )
    messages = [
        {"role": "system", "content": "skipped"},
        {"role": "user", "content": "ü <b>&'\"", "name": None},
        {"role": "assistant", "content": "stop"},
        {"role": "user", "content": "after the break"},
    ]
    for add_generation_prompt in (True, False):
        rendered = served.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert rendered == reference.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert (
            '"ü <b>&\'\\""' in rendered
            and "after the break" not in rendered
            and "None" not in rendered
        )


@pytest.mark.parametrize(
    "template, error",
    [
        ("{{ raise_exception('roles must alternate') }}", jinja2.TemplateError),
        ("{% set ns = namespace(_private=1) %}", jinja2.exceptions.SecurityError),
        ("{{ messages.append(1) }}", jinja2.exceptions.SecurityError),
        ("{% for %}", jinja2.TemplateError),
    ],
)
def test_a_template_that_refuses_raises_as_in_transformers(template, error):
    reference = tiny.byte_tokenizer()
    reference.chat_template = template
    served = ServedTokenizer(
        reference.backend_tokenizer.to_str(), template, reference.special_tokens_map
    )
    with pytest.raises(error):
        reference.apply_chat_template(CHATS[0], tokenize=False)
    with pytest.raises(error):
        served.apply_chat_template(CHATS[0], tokenize=False)


def test_a_tokenizer_that_does_not_rebuild_to_its_fingerprint_is_refused(tiny_target):
    served = served_tokenizer(tiny_target)
    served.fingerprint = "0123456789abcdef"
    with pytest.raises(FailedPrecondition, match="set --tokenizer"):
        ServedTokenizer.from_served(served)


def test_the_tokenizer_comes_from_a_live_target_over_grpc(tiny_target):
    class Target(target_pb2_grpc.TargetServiceServicer):
        def GetTokenizer(self, request, context):
            return served_tokenizer(tiny_target)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    target_pb2_grpc.add_TargetServiceServicer_to_server(Target(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            worker = SimpleNamespace(
                stub=target_pb2_grpc.TargetServiceStub(channel), worker_id="t", address="a"
            )
            pool = SimpleNamespace(live_targets=lambda: [worker])
            tokenizer = TargetTokenizer(pool, timeout_s=10).get()
            assert tokenizer.fingerprint == tiny_target.fingerprint
            worker.stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel("127.0.0.1:1"))
            with pytest.raises(Unavailable, match="cannot fetch the tokenizer from target t"):
                TargetTokenizer(pool, timeout_s=1).get()
    finally:
        server.stop(None)
    nobody = SimpleNamespace(live_targets=lambda: [], why_empty=lambda message: message)
    with pytest.raises(Unavailable, match="no target worker is reachable"):
        TargetTokenizer(nobody).get()


def test_the_override_takes_a_saved_tokenizer_or_its_json(tmp_path, tiny_target):
    tiny_target.tokenizer.save_pretrained(tmp_path)
    from_directory = load_tokenizer_override(str(tmp_path))
    assert isinstance(from_directory, ServedTokenizer)
    _assert_same_tokenizer(from_directory, tiny_target.tokenizer)
    from_json = load_tokenizer_override(str(tmp_path / "tokenizer.json"))
    assert from_json.encode("abc") == tiny_target.tokenizer("abc").input_ids


def test_importing_the_orchestrator_imports_no_torch_nor_transformers():
    script = (
        "import sys, orchestrator.server, orchestrator.tokenizer; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy')))"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, check=True
    )
    assert run.stdout.strip() == "[]", run.stdout


def test_the_served_tokenizer_is_compact(tiny_target):
    served = served_tokenizer(tiny_target)
    assert (
        gzip.decompress(served.tokenizer_json_gzip).decode()
        == tiny_target.tokenizer.backend_tokenizer.to_str()
    )
    # same bytes each time
    assert served_tokenizer(tiny_target).tokenizer_json_gzip == served.tokenizer_json_gzip
    assert served.special_tokens == {"eos_token": tiny.END_OF_TEXT}


def test_the_tokenizer_is_fetched_ahead_once_a_target_appears(tiny_target):
    import time

    targets = []
    worker = SimpleNamespace(
        worker_id="t",
        address="a",
        stub=SimpleNamespace(GetTokenizer=lambda request, timeout: served_tokenizer(tiny_target)),
    )
    pool = SimpleNamespace(live_targets=lambda: list(targets), why_empty=lambda message: message)
    tokenizer = TargetTokenizer(pool)
    tokenizer.fetch_ahead(period_s=0.05)
    try:
        targets.append(worker)  # a target begins serving
        deadline = time.monotonic() + 10
        while tokenizer._tokenizer is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (
            tokenizer._tokenizer is not None
            and tokenizer.get().fingerprint == tiny_target.fingerprint
        )
    finally:
        tokenizer.stop()
