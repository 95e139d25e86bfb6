"""ModelSession: lazy forward passes and absolute rollback of the KV cache.

Cached and uncached passes sum in different orders, so logits agree to fp32 rounding
(1e-4 on logits of magnitude ~10), not bit for bit; exact token equality is what the
greedy equivalence tests demand.
"""

from __future__ import annotations

import pytest
import torch

from foundation.errors import InvalidArgument
from model_runtime.model_session import ModelSession


def _full_logits(loaded, token_ids) -> torch.Tensor:
    with torch.inference_mode():
        return loaded.model(input_ids=torch.tensor([token_ids])).logits[0]


def test_incremental_logits_match_a_full_forward(tiny_target, prompt_ids):
    ids = prompt_ids[0]
    session = ModelSession(tiny_target.model, tiny_target.context_length)
    session.append(ids[:5])
    session.prefill()
    assert session.cached_length == 4  # the last token stays pending
    session.append(ids[5:9])
    logits = session.logits(5)  # positions 4..8
    torch.testing.assert_close(
        logits, _full_logits(tiny_target, ids[:9])[4:9], rtol=1e-4, atol=1e-4
    )


def test_truncate_then_extend_equals_a_fresh_session(tiny_target, prompt_ids):
    ids = prompt_ids[1]
    session = ModelSession(tiny_target.model, tiny_target.context_length)
    session.append(ids)
    session.logits(1)
    session.truncate_to(6)
    assert session.length == 6 and session.cached_length == 6
    session.append([7, 8, 9])
    rolled_back = session.logits(3)
    fresh = _full_logits(tiny_target, ids[:6] + [7, 8, 9])[-3:]
    torch.testing.assert_close(rolled_back, fresh, rtol=1e-4, atol=1e-4)


def test_logits_after_rollback_rerun_a_cached_token(tiny_target, prompt_ids):
    """Nothing pending after a rollback: the last token is run again, not made up."""
    ids = prompt_ids[2]
    session = ModelSession(tiny_target.model, tiny_target.context_length)
    session.append(ids)
    session.logits(1)
    session.truncate_to(len(ids) - 3)
    before = session.num_forward_tokens
    logits = session.logits(1)
    assert session.num_forward_tokens == before + 1
    torch.testing.assert_close(
        logits[0], _full_logits(tiny_target, ids[:-3])[-1], rtol=1e-4, atol=1e-4
    )


def test_truncate_is_absolute_and_repeatable(tiny_target):
    session = ModelSession(tiny_target.model, tiny_target.context_length)
    session.append([1, 2, 3, 4, 5])
    session.logits(1)
    session.truncate_to(3)
    session.truncate_to(3)  # a duplicated rollback is harmless
    assert session.token_ids == [1, 2, 3]
    with pytest.raises(InvalidArgument, match="cannot truncate a 3-token sequence to 4"):
        session.truncate_to(4)


def test_context_length_is_enforced(tiny_target):
    session = ModelSession(tiny_target.model, context_length=8)
    session.append(list(range(8)))
    with pytest.raises(InvalidArgument, match="exceeds the model's context length of 8 tokens"):
        session.append([1])
    assert session.length == 8  # the failed append changed nothing


def test_release_frees_the_cache_and_keeps_the_tokens(tiny_target, prompt_ids):
    ids = prompt_ids[3]
    session = ModelSession(tiny_target.model, tiny_target.context_length)
    session.append(ids)
    expected = session.logits(1)
    session.release()
    assert session.cached_length == 0 and session.token_ids == ids
    torch.testing.assert_close(session.logits(1), expected, rtol=1e-4, atol=1e-4)


def test_warm_up_runs_every_width_and_leaves_the_model_as_it_was(tiny_target):
    from model_runtime.warmup import warm_up

    ids = [5, 6, 7, 8]
    session = ModelSession(tiny_target.model, tiny_target.context_length)
    session.append(ids)
    before = session.logits(2).clone()
    assert warm_up(tiny_target, max_width=5) > 0
    again = ModelSession(tiny_target.model, tiny_target.context_length)
    again.append(ids)
    assert torch.equal(again.logits(2), before)
