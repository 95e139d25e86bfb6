"""Typed configuration: a dataclass whose fields become kebab-case flags, each also read
from an environment variable (PREFIX_FIELD_NAME), flags winning over the environment."""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing


def env_name(prefix: str, field_name: str) -> str:
    return f"{prefix}_{field_name.upper()}"


def add_arguments(parser: argparse.ArgumentParser, config_class, env_prefix: str) -> None:
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        kind = hints[field.name]
        env = env_name(env_prefix, field.name)
        default = os.environ.get(env, field.default)
        help_text = f"{field.metadata.get('help', '')} (env {env}; default {field.default!r})"
        flag = "--" + field.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=_as_bool(default),
                help=help_text,
            )
        else:
            parser.add_argument(flag, type=_base_type(kind), default=default, help=help_text)


def from_args(config_class, args: argparse.Namespace):
    hints = typing.get_type_hints(config_class)
    values = {}
    for field in dataclasses.fields(config_class):
        value = getattr(args, field.name)
        if value is not None and not isinstance(value, bool):
            value = _base_type(hints[field.name])(value)
        values[field.name] = value
    return config_class(**values)


def parse(config_class, env_prefix: str, argv=None, description: str | None = None):
    """Flags and environment; the program is named after the config's package."""
    package = config_class.__module__.split(".")[0]
    parser = argparse.ArgumentParser(prog=f"python -m {package}", description=description)
    add_arguments(parser, config_class, env_prefix)
    return from_args(config_class, parser.parse_args(argv))


def _base_type(kind):
    """int | None -> int; str -> str."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if args else kind


def _as_bool(value) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)
