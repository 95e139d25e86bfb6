"""The drafters a draft worker offers, by name, and how a session's drafter is set up
for one Speculate call.

"model" is the worker's small model (`--model`), "ngram" prompt lookup (no model),
"ngram+model" lookup where the context has text to copy and the model elsewhere. A
session keeps the drafter it was opened with; each Speculate call brings its own
sampling params, draft truncation and n-gram sizes, applied here before its rounds.

Forward passes of the draft model run on a StepScheduler, as on the target worker: the
drafting steps of every session that drafts at the same time share one forward pass
(draft_service.draft_model). Without a model, nothing here imports torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from foundation.errors import InvalidArgument
from speculative.drafter_base import Drafter, DraftSession, Proposal
from speculative.prompt_lookup import (
    LookupThenModelDrafter,
    LookupThenModelSession,
    NgramDrafter,
    NgramDraftSession,
)
from speculative.types import (
    MODEL,
    NGRAM,
    NGRAM_THEN_MODEL,
    PLUGIN_PREFIX,
    SamplingParams,
    check_drafter_name,
)

if TYPE_CHECKING:
    from draft_service.draft_model import DraftModel
    from model_runtime.step_scheduler import StepScheduler
    from speculative.drafters import ModelDraftSession


@dataclass(frozen=True)
class DraftSettings:
    """How one Speculate call drafts (the output is the target's whatever these are)."""

    params: SamplingParams  # the target's sampling params: greedy or sampled drafts, seed
    draft_top_k: int  # support of the draft's sampled distribution, in tokens
    min_ngram: int  # n-gram drafter: shortest suffix looked up, in tokens
    max_ngram: int  # n-gram drafter: longest suffix looked up, in tokens


class Drafters:
    """The worker's drafters: n-gram lookup and, if a model is loaded, the model drafter
    and the two together."""

    def __init__(
        self,
        model: DraftModel | None,
        default_drafter: str,
        min_ngram: int,
        max_ngram: int,
        plugin: str = "",
    ):
        self.model = model
        self.loaded = model.loaded if model is not None else None
        self.by_name: dict[str, Drafter] = {NGRAM: NgramDrafter(min_ngram, max_ngram)}
        if model is not None:
            self.by_name[MODEL] = model.drafter
            self.by_name[NGRAM_THEN_MODEL] = LookupThenModelDrafter(
                model.drafter, self.by_name[NGRAM]
            )
        self.plugged = plugin_drafters(plugin, model) if plugin else {}
        self.by_name |= self.plugged
        # the drafters that run the worker's model (a plug-in's run it where there is one)
        self.with_model = {MODEL, NGRAM_THEN_MODEL, *self.plugged} if model is not None else set()
        self.default = self.resolve(default_drafter)  # fails at start-up, not per request

    def resolve(self, name: str) -> str:
        """The drafter's name (empty = the worker's default); InvalidArgument if unknown
        or not available on this worker."""
        check_drafter_name(name)
        if not name:
            return self.default
        if name.startswith(PLUGIN_PREFIX) and name not in self.by_name:
            raise InvalidArgument(
                f"drafter {name!r} is a plug-in's: offered only by a draft worker started "
                "with the --drafter-plugin that adds it"
            )
        if name not in self.by_name:
            raise InvalidArgument(
                f"drafter {name!r} needs a draft model, and this draft worker was started without "
                f"one (--model / DRAFT_MODEL): use drafter {NGRAM!r}"
            )
        return name

    def fingerprint(self, name: str) -> str:
        return self.by_name[name].fingerprint

    def model_name(self, name: str) -> str:
        return self.by_name[name].name

    def check_tokens(self, name: str, num_existing: int, token_ids: Sequence[int]) -> None:
        """New input tokens must be in the vocabulary and leave room to generate."""
        if not token_ids:
            raise InvalidArgument("no token ids given: send at least one")
        limit = self.loaded.vocab_size if name in self.with_model else None
        bad = [t for t in token_ids if t < 0 or (limit is not None and t >= limit)]
        if bad:
            vocabulary = f"[0, {limit})" if limit is not None else "ids >= 0"
            raise InvalidArgument(
                f"token ids {bad[:5]} are outside the draft vocabulary {vocabulary}"
            )
        if name in self.with_model and num_existing + len(token_ids) >= self.loaded.context_length:
            raise InvalidArgument(
                f"{num_existing + len(token_ids)} tokens leave no room to generate in the draft "
                f"model's context length of {self.loaded.context_length} tokens"
            )

    def context_length(self, name: str) -> int | None:
        """The drafter's own limit on a sequence, in tokens (None: no limit)."""
        return self.loaded.context_length if name in self.with_model else None

    def open(self, name: str, prompt_token_ids: Sequence[int]) -> DraftSession:
        """Opens and prefills; the sampling params arrive with each Speculate call."""
        self.check_tokens(name, 0, prompt_token_ids)
        if name == NGRAM or (name in self.plugged and name not in self.with_model):
            return self.by_name[name].open(prompt_token_ids, SamplingParams())
        if name in self.plugged:  # a plug-in's over the model: its passes on the scheduler
            session = SerializedModelDraftSession(
                self.by_name[name].open(prompt_token_ids, SamplingParams()), self.model.compute
            )
            session.prefill()
            return session
        model = SerializedModelDraftSession(
            self.by_name[MODEL].open(prompt_token_ids, SamplingParams()), self.model.compute
        )
        session = (
            model
            if name == MODEL
            else LookupThenModelSession(
                self.by_name[NGRAM].open(prompt_token_ids, SamplingParams()), model
            )
        )
        session.prefill()  # now, alongside the target's prefill, not in the first round
        return session


def plugin_drafters(spec: str, model: DraftModel | None) -> dict[str, Drafter]:
    """A draft worker's plug-in (--drafter-plugin MODULE:FUNCTION[:ARGUMENT], benchmarks
    and tests only): FUNCTION(the worker's DraftModel or None, ARGUMENT) gives drafters
    by name, each name starting with PLUGIN_PREFIX."""
    module_name, _, rest = spec.partition(":")
    function_name, _, argument = rest.partition(":")
    if not module_name or not function_name:
        raise InvalidArgument(f"--drafter-plugin must be MODULE:FUNCTION[:ARGUMENT], got {spec!r}")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise InvalidArgument(f"cannot load the drafter plug-in {spec!r}: {error}") from None
    drafters = dict(function(model, argument))
    misnamed = [name for name in drafters if not name.startswith(PLUGIN_PREFIX)]
    if misnamed:
        raise InvalidArgument(
            f"drafter plug-in {spec!r} names {misnamed}: a plug-in's names start with {PLUGIN_PREFIX!r}"
        )
    return drafters


class SerializedModelDraftSession(DraftSession):
    """A model draft session whose forward passes run on the worker's step scheduler,
    batched with the other sessions' drafting steps."""

    def __init__(self, inner: ModelDraftSession, compute: StepScheduler):
        self.inner = inner
        self.compute = compute

    @property
    def length(self) -> int:
        return self.inner.length

    def propose(self, k: int, min_reach: float = 0.0) -> Proposal:
        return self.compute.submit(self.inner.propose_steps(k, min_reach))[0]

    def propose_tree(
        self, k: int, width: int, min_reach: float = 0.0, min_branch: float = 0.0
    ) -> Proposal:
        return self.compute.submit(self.inner.propose_steps(k, min_reach, width, min_branch))[0]

    def prefill(self) -> None:
        self.compute.submit(self.inner.prefill_steps())

    def set_sampling(self, params: SamplingParams) -> None:
        self.inner.set_sampling(params)

    def append(self, token_ids: Sequence[int]) -> None:
        self.inner.append(token_ids)

    def truncate_to(self, length: int) -> None:
        self.inner.truncate_to(length)

    def release(self) -> None:
        self.inner.release()


def apply_settings(draft: DraftSession, settings: DraftSettings) -> None:
    """Sets up a session's drafter for one Speculate call.

    A seed restarts the draft's generator exactly as the in-process generator seeds it
    (from the request's seed), so a seeded call reproduces SpeculativeGenerator's output.
    """
    if isinstance(draft, LookupThenModelSession):
        apply_settings(draft.lookup, settings)
        apply_settings(draft.model, settings)
        return
    draft.set_sampling(settings.params)
    if isinstance(draft, SerializedModelDraftSession):
        draft.inner.draft_top_k = settings.draft_top_k
    elif isinstance(draft, NgramDraftSession):
        draft.min_ngram, draft.max_ngram = settings.min_ngram, settings.max_ngram


def prefill(draft: DraftSession) -> None:
    """Runs new input tokens through the draft model now rather than in the next round."""
    draft.prefill()
