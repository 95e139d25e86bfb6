"""The fleet model against closed forms: M/D/1 queueing, a saturated target, a session
alone, Leviathan's expected tokens a round; and the project's policy driving it."""

from __future__ import annotations

import math

import pytest
import simpy

from planner.fleet import (
    TARGET_ONLY,
    Cell,
    Device,
    Layout,
    Result,
    Speculation,
    _Work,
    saturate,
    simulate,
)
from speculative.estimator import expected_tokens

COLOCATED, REMOTE = Cell(Layout.COLOCATED), Cell(Layout.REMOTE, targets=1, drafts=1)


def test_one_slot_and_one_pass_a_request_queue_as_m_d_1(make_costs):
    # Each request is one pass of D ms; one session at a time: an M/D/1 queue, whose mean
    # number waiting is rho^2 / (2 (1 - rho)) (Pollaczek-Khinchine).
    service_ms, rho = 10.0, 0.6
    costs = make_costs(
        target={"base_ms": service_ms, "per_token_ms": 0.0, "max_sessions": 1},
        request={"new_tokens": 1},
    )
    rate = rho / service_ms * 1000.0
    result = simulate(costs, Cell(Layout.TARGET_ONLY), TARGET_ONLY, rate, requests=20_000)
    assert result.mean_queue == pytest.approx(rho**2 / (2 * (1 - rho)), rel=0.1)
    assert result.ttft_p90_ms >= service_ms


def test_a_saturated_target_serves_its_sessions_a_token_each_pass(make_costs):
    # Four sessions a pass of 10 ms, one token each: 400 tokens a second, TPOT 10 ms.
    costs = make_costs(
        target={"base_ms": 10.0, "per_token_ms": 0.0, "max_sessions": 4},
        request={"new_tokens": 50},
    )
    result = saturate(costs, Cell(Layout.TARGET_ONLY), TARGET_ONLY)
    assert result.tokens_per_s == pytest.approx(400.0, rel=0.02)
    assert result.rate_per_s == pytest.approx(400.0 / 50, rel=0.02)
    assert result.tpot_p50_ms == pytest.approx(10.0)


@pytest.mark.parametrize("cell", [COLOCATED, REMOTE], ids=["co-located", "remote"])
def test_every_token_accepted_commits_k_plus_1_a_pass(make_costs, cell):
    k = 3
    costs = make_costs(acceptance=(1.0,) * k, request={"new_tokens": 1 + 5 * (k + 1)})
    result = simulate(costs, cell, Speculation(k), rate_per_s=5.0, requests=20)
    assert result.tokens_per_round == k + 1
    assert result.drafted_per_round == k


@pytest.mark.parametrize(
    "cell, round_ms",
    [
        # k d + c(k + 1): a co-located draft's steps take the target's device.
        (COLOCATED, 3 * 2.0 + (10.0 + 4 * 1.0)),
        # k d + 2 L + c(k + 1): a remote draft adds the link both ways.
        (REMOTE, 3 * 2.0 + 2 * 1.0 + (10.0 + 4 * 1.0)),
        # target-only: c(1) a token.
        (Cell(Layout.TARGET_ONLY), 4 * (10.0 + 1.0)),
    ],
    ids=["co-located", "remote", "target-only"],
)
def test_a_session_alone_takes_a_round_for_k_plus_1_tokens(make_costs, cell, round_ms):
    k = 3
    costs = make_costs(acceptance=(1.0,) * k, request={"new_tokens": 1 + 6 * (k + 1)})
    spec = TARGET_ONLY if cell.layout is Layout.TARGET_ONLY else Speculation(k)
    result = simulate(costs, cell, spec, rate_per_s=0.001, requests=1, warmup=0.0)
    assert result.tpot_p50_ms == pytest.approx(round_ms / (k + 1))


def test_simulated_tokens_a_round_match_leviathan_within_its_spread(make_costs):
    acceptance, k, requests, new_tokens = 0.7, 4, 3, 4001
    costs = make_costs(acceptance=(acceptance,) * k, request={"new_tokens": new_tokens})
    result = simulate(costs, COLOCATED, Speculation(k), 1.0, requests=requests, warmup=0.0)
    # tokens a round: 1 + j with probability a^j (1 - a) for j < k, a^k for j = k
    probabilities = [acceptance**j * (1 - acceptance) for j in range(k)] + [acceptance**k]
    mean = expected_tokens(acceptance, k)
    spread = math.sqrt(sum(p * (1 + j - mean) ** 2 for j, p in enumerate(probabilities)))
    rounds = requests * (new_tokens - 1) / result.tokens_per_round
    # 4 standard errors, and each request's last round cut to what is left
    bound = 4 * spread / math.sqrt(rounds) + requests * k / rounds
    assert sum(probabilities) == pytest.approx(1.0)
    assert abs(result.tokens_per_round - mean) < bound


def test_the_simulation_is_reproducible_by_its_seed(make_costs):
    costs = make_costs()
    runs = [simulate(costs, REMOTE, Speculation(3), 20.0, requests=40, seed=s) for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_adaptive_drafts_long_rounds_where_every_token_is_accepted(make_costs):
    costs = make_costs(
        acceptance=(1.0,) * 6,
        draft={"ms_by_batch": ((1, 0.1),)},
        target={"per_token_ms": 0.1},
        request={"new_tokens": 401},
    )
    result = simulate(costs, REMOTE, Speculation(None, 6), 1.0, requests=2, warmup=0.0)
    assert result.drafted_per_round > 5.0 and result.stretch_share < 0.1


def test_adaptive_backs_off_where_no_draft_token_is_accepted(make_costs):
    costs = make_costs(acceptance=(0.0,) * 4, draft={"ms_by_batch": ((1, 20.0),)})
    adaptive = simulate(costs, REMOTE, Speculation(None, 4), 2.0, requests=10)
    fixed = simulate(costs, REMOTE, Speculation(2), 2.0, requests=10)
    assert adaptive.stretch_share > 0.5
    assert adaptive.tpot_p50_ms < 0.5 * fixed.tpot_p50_ms


def test_a_remote_pool_frees_the_target_where_drafting_is_costly(make_costs):
    # Drafting 4 ms a token on the target's device, as much on a draft worker: at
    # saturation the remote pool leaves the target its passes alone.
    costs = make_costs(acceptance=(0.8,) * 3, draft={"ms_by_batch": ((1, 4.0),)})
    colocated = saturate(costs, COLOCATED, Speculation(3))
    remote = saturate(costs, REMOTE, Speculation(3))
    assert remote.tokens_per_s > 1.2 * colocated.tokens_per_s
    assert 0 < remote.draft_busy <= 1.0


def test_a_prompt_rides_passes_in_chunks_held_to_the_prefill_share(make_costs):
    """As the target's step scheduler: beside a session decoding (a pass of 10 + 1 ms), a
    100-token prompt at 1 ms a token adds at most half that pass, 5 tokens; with no one
    decoding it goes whole."""
    costs = make_costs(target={"prefill_token_ms": 1.0, "prefill_share": 0.5})
    env = simpy.Environment()
    device = Device(env, costs, colocated=False)
    decoding, prompt = _Work(1, 0, 0.0, env.event()), _Work(1, 100, 0.0, env.event())
    device.work = [decoding, prompt]
    assert device._prefill_chunks(rows=1, tokens=1, budget=0) == [(prompt, 5)]
    assert device._prefill_chunks(rows=0, tokens=0, budget=0) == [(prompt, 100)]
    assert device._prefill_chunks(rows=0, tokens=0, budget=64) == [(prompt, 64)]


def test_chunked_prompts_stall_the_sessions_decoding_less(make_costs):
    """Long prompts arriving among decoding sessions: held to the share, the decoding
    sessions' TPOT p90 is lower than with every prompt in one pass, their TTFT longer."""

    def run(share: float) -> Result:
        costs = make_costs(
            target={"prefill_token_ms": 1.0, "prefill_share": share},
            request={"prompt_tokens": 400, "new_tokens": 40},
        )
        return simulate(costs, Cell(Layout.TARGET_ONLY), TARGET_ONLY, 3.0, requests=80)

    held, whole = run(0.5), run(1e9)
    assert held.tpot_p90_ms < 0.8 * whole.tpot_p90_ms
    assert held.ttft_p90_ms > whole.ttft_p90_ms


def test_a_free_prompt_token_is_priced_at_the_compute_floor(make_costs):
    """At a GPU's roofline a prompt token costs nothing until the pass is compute-bound:
    the share is priced at the floor; with no floor either, a prompt goes whole."""
    env = simpy.Environment()
    floor = make_costs(target={"prefill_token_ms": 0.0, "compute_per_token_ms": 0.5})
    free = make_costs(target={"prefill_token_ms": 0.0})
    for costs, expected in ((floor, 11), (free, 100)):  # 0.5 x 11 ms / 0.5 ms a token
        device = Device(env, costs, colocated=False)
        prompt = _Work(1, 100, 0.0, env.event())
        device.work = [_Work(1, 0, 0.0, env.event()), prompt]
        assert device._prefill_chunks(rows=1, tokens=1, budget=0) == [(prompt, expected)]
