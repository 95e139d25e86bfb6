"""Chat templates rendered the way transformers renders them, without transformers.

A model's chat template is Jinja written for transformers' `apply_chat_template`, so it
must see the same environment there and here, or the prompt's tokens differ:
- a sandboxed, immutable environment with `trim_blocks` and `lstrip_blocks`, and the
  loop controls (`break`, `continue`);
- `tojson` that keeps non-ASCII text and HTML characters as they are, and takes
  `indent`, `separators`, `sort_keys`;
- the globals `raise_exception(message)`, `strftime_now(format)`, a `dict` constructor
  and a `namespace` that refuses names starting with an underscore;
- the `{% generation %}` block tag (assistant masks in training), rendered as its body;
- the variables `messages` (keys whose value is None dropped), `tools`, `documents`,
  `add_generation_prompt` and the named special tokens (`bos_token`, `eos_token`, ...).
tests/orchestrator/test_tokenizer.py checks the output against transformers' own.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


def render_chat_template(
    template: str,
    messages: Sequence[Mapping],
    special_tokens: Mapping[str, str],
    add_generation_prompt: bool,
) -> str:
    """The prompt text. jinja2.TemplateError, as in transformers, for a conversation the
    template refuses (its raise_exception) or a broken template."""
    return _compiled(template).render(
        messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
        tools=None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **special_tokens,
    )


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_DictConstructor(),
        namespace=_Namespace,
    )
    return environment.from_string(template)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML: a prompt is not HTML.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


class _DictConstructor:
    """`dict(...)` for templates, without the attributes of the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore names (a way towards CPython internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 - Jinja's signature, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot set {name!r} on a namespace"
            )


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's text for training
    masks in transformers; a prompt renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()
