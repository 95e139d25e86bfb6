"""The vocabulary the core shares with the services: sampling parameters, drafter names,
why a generation finished, a target's verdict and what kind of token it adds.

Free of torch on purpose (like limits.py and stats.py): the orchestrator validates
requests and reads results with these types, the n-gram draft worker runs its rounds
with them, and neither loads a model runtime. The modules of the core that compute with
them (sampling.py, rejection.py, target.py, drafters.py) import them from here.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from foundation.errors import InvalidArgument

if TYPE_CHECKING:
    from foundation.load import StepLoad


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is turned into tokens."""

    temperature: float = 0.0  # 0 = greedy argmax; > 0 divides the logits
    top_k: int = 0  # keep the k most likely tokens; 0 = disabled
    top_p: float = 1.0  # keep the smallest set with this much probability; 1 = disabled
    seed: int | None = None  # None = a fresh random seed per request
    max_new_tokens: int = 64  # hard limit on generated tokens
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # e.g. the EOS id

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> SamplingParams:
        """Raises InvalidArgument naming the first bad field; returns self."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise InvalidArgument(
                f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}"
            )
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidArgument(f"seed must be in [0, 2**63), got {self.seed}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidArgument(f"stop_token_ids must be >= 0, got {list(self.stop_token_ids)}")
        return self

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens or the context length reached
    STOP_TOKEN = "stop_token"  # a stop token id was generated (it is included)


class NextTokenKind(enum.Enum):
    RECOVERED = "recovered"  # replaces the first rejected draft token
    BONUS = "bonus"  # follows a fully accepted proposal


@dataclass(frozen=True)
class Verdict:
    """The target's decision on one proposal (speculative.rejection decides it)."""

    num_accepted: int  # length of the accepted prefix of the draft tokens
    next_token_id: int  # the recovered or bonus token committed after them
    next_token_kind: NextTokenKind

    def committed_tokens(self, draft_token_ids: Sequence[int]) -> list[int]:
        """The tokens this verdict commits: accepted draft tokens, then the next token."""
        return [*draft_token_ids[: self.num_accepted], self.next_token_id]


@dataclass(frozen=True)
class VerifyResult:
    """A verdict as applied to the target's session (speculative.target.TargetSession)."""

    verdict: Verdict
    token_ids: list[int]  # tokens committed this round: accepted + next, cut after a stop token
    committed_len: int  # the session's committed length afterwards, in tokens
    stopped: bool  # a stop token ended the round
    target_compute_ns: (
        int  # forward pass and decision, in nanoseconds (0: no pass ran, logits were kept)
    )
    step: StepLoad | None = None  # the batched step that ran it (None: run alone)
    received_ns: int = 0  # when it reached the draft (time.perf_counter_ns; 0: as it was read)
    num_drafted: int = (
        0  # draft tokens the pass judged (in a stretch: looked-up tokens it verified)
    )
    path: tuple[int, ...] | None = (
        None  # a token tree's accepted nodes, root-most first (None: a chain)
    )
    # The target worker's whole time on the proposal, compute, queue and host work (0: not measured), in ns.
    target_handled_ns: int = 0


# The drafters a draft worker offers, by the names of the API (SpeculationParams.drafter).
MODEL = "model"  # the worker's small model
NGRAM = "ngram"  # prompt lookup, no model
NGRAM_THEN_MODEL = "ngram+model"  # prompt lookup where it finds text to copy, the model elsewhere
DRAFTER_NAMES = (MODEL, NGRAM, NGRAM_THEN_MODEL)
# Drafters a draft worker's plug-in adds (--drafter-plugin: benchmarks and tests) are
# named with this prefix, never with a production name.
PLUGIN_PREFIX = "x-"


def check_drafter_name(name: str) -> None:
    """InvalidArgument unless `name` is a drafter of the API, a plug-in's (PLUGIN_PREFIX:
    the draft worker says whether it has it) or empty (the worker's default)."""
    if name and name not in DRAFTER_NAMES and not name.startswith(PLUGIN_PREFIX):
        names = ", ".join(repr(known) for known in DRAFTER_NAMES)
        raise InvalidArgument(
            f"unknown drafter {name!r}: drafter must be one of {names} or empty (the worker's default)"
        )
