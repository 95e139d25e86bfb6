"""A benchmark-only drafter of known acceptance: the target's own recorded greedy
continuation, with tokens replaced at a chosen rate, at a real draft model's cost.

Why: on a machine that can fetch no weights, models are random and acceptance is
meaningless, so speculation's speed there says nothing. This drafter proposes, at each
position, the token the target decoded there alone (recorded beforehand: a greedy run
of the same prompt), replaced by another token with probability 1 - acceptance (drawn
per position from a seed, so a position is either always right or always wrong), and
runs one pass of its draft model for every token it proposes (the draft's real cost).
The measured speed is then the system's at that acceptance.

Never a default, never a public drafter name: a draft worker offers it as "x-replay"
only when started with `--drafter-plugin benchmarks.replay_drafter:drafters:FILE` (the
worker's plug-in hook, draft_service/drafting.py), and every result that uses it says
so. Greedy only (a recorded greedy continuation says nothing of sampled ones).

The replay file is JSON, read again whenever a session opens (a benchmark can record
target-only output and change the acceptance while the workers run):
`{"acceptance": 0.8, "seed": 0, "sequences": [[prompt and continuation token ids], ...]}`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

from foundation.errors import InvalidArgument
from model_runtime.loading import LoadedModel
from model_runtime.model_session import ForwardSteps, ModelSession
from speculative.drafter_base import Drafter, Proposal
from speculative.drafters import ModelDraftSession
from speculative.sampling import SamplingParams


@dataclass(frozen=True)
class Replay:
    acceptance: float  # the chance that a proposed token is the target's, per position
    seed: int  # which positions are replaced
    sequences: tuple[tuple[int, ...], ...]  # [num_recordings][prompt + continuation] token ids

    @classmethod
    def read(cls, path: str) -> Replay:
        try:
            with open(path) as file:
                data = json.load(file)
            replay = cls(
                float(data["acceptance"]),
                int(data.get("seed", 0)),
                tuple(tuple(int(t) for t in s) for s in data["sequences"]),
            )
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise InvalidArgument(f"cannot read the replay file {path!r}: {error}") from None
        if not 0.0 <= replay.acceptance <= 1.0:
            raise InvalidArgument(f"replay acceptance must be in [0, 1], got {replay.acceptance}")
        return replay

    def recording(self, prompt: Sequence[int]) -> tuple[int, ...]:
        """The longest recording that starts with `prompt` (empty: none does)."""
        prompt = tuple(prompt)
        matching = [s for s in self.sequences if s[: len(prompt)] == prompt]
        return max(matching, key=len, default=())

    def replaced(self, recording: tuple[int, ...], position: int) -> bool:
        """Whether the recording's token at `position` is proposed replaced: drawn per
        recording and position from the seed, the same every time it is proposed."""
        digest = hashlib.sha256(f"{self.seed}:{hash(recording)}:{position}".encode()).digest()
        return int.from_bytes(digest[:8], "little") / 2**64 >= self.acceptance


def write_replay(
    path: str, acceptance: float, sequences: Sequence[Sequence[int]], seed: int = 0
) -> None:
    """Writes a replay file (atomically: a worker may be reading it)."""
    with open(path + ".tmp", "w") as file:
        json.dump(
            {"acceptance": acceptance, "seed": seed, "sequences": [list(s) for s in sequences]},
            file,
        )
    os.replace(path + ".tmp", path)


NAME = "x-replay"  # a plug-in's name (speculative.types.PLUGIN_PREFIX)


def drafters(model, replay_file: str) -> dict[str, Drafter]:
    """The draft worker's plug-in hook (--drafter-plugin): the replay drafter over the
    worker's model, reading `replay_file`."""
    if model is None:
        raise InvalidArgument("the replay drafter needs a --model: it pays the model's passes")
    if not replay_file:
        raise InvalidArgument("the replay drafter needs its file: MODULE:FUNCTION:FILE")
    return {NAME: ReplayDrafter(model.loaded, replay_file)}


class ReplayDrafter(Drafter):
    def __init__(self, loaded: LoadedModel, path: str):
        self.loaded = loaded
        self.path = path
        self.name = f"replay:{loaded.name}"
        self.fingerprint = loaded.fingerprint

    def open(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> ReplayDraftSession:
        session = ModelSession(self.loaded.model, self.loaded.context_length)
        session.append(prompt_token_ids)
        replay = Replay.read(self.path)
        return ReplayDraftSession(
            session, replay, replay.recording(prompt_token_ids), self.loaded.vocab_size
        )


class ReplayDraftSession(ModelDraftSession):
    """A model draft session (its cache, its passes, its rollback) that proposes the
    recording's tokens instead of its own."""

    def __init__(
        self, session: ModelSession, replay: Replay, recording: tuple[int, ...], vocab_size: int
    ):
        super().__init__(session, SamplingParams(), draft_top_k=1)
        self.replay = replay
        self.recording = recording
        self.vocab_size = vocab_size

    def set_sampling(self, params: SamplingParams) -> None:
        if not params.greedy:
            raise InvalidArgument(
                "the replay drafter is greedy only: its recordings are greedy continuations"
            )

    def propose_steps(
        self, k: int, min_reach: float = 0.0, width: int = 1, min_branch: float = 0.0
    ) -> ForwardSteps[Proposal]:
        """Up to k tokens of the recording (replaced where the replay says), each after a
        pass of the draft model over the pending tokens, as a model drafter pays."""
        token_ids: list[int] = []
        while len(token_ids) < k and self.session.length < len(self.recording):
            segment = self.session.pending_segment(1)
            yield segment  # the draft model's pass: its cost, its logits unused
            self.session.segment_done(segment)
            position = self.session.length
            token_id = self.recording[position]
            if self.replay.replaced(self.recording, position):
                token_id = (token_id + 1) % self.vocab_size
            token_ids.append(token_id)
            self.session.append([token_id])
        return Proposal(token_ids)
