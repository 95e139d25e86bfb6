"""Small CPU steps at the cheapest width (model_runtime/width_padding.py): the plan picks
a wider step only where timing says it is cheaper by the margin, and padding a step
changes no output, greedy or sampled, with or without speculation."""

from __future__ import annotations

import pytest
import torch

from model_runtime import width_padding
from model_runtime.batched_forward import padded_rows
from model_runtime.loading import load_model
from model_runtime.width_padding import WidthPlan
from speculative.drafters import ModelDrafter
from speculative.generator import SpeculativeGenerator
from speculative.sampling import SamplingParams


def test_a_step_runs_at_the_cheapest_width_at_least_as_wide():
    plan = WidthPlan.from_costs({1: 230.0, 2: 290.0, 3: 190.0, 4: 200.0, 5: 180.0})
    assert [plan.width(rows) for rows in range(1, 6)] == [
        3,
        3,
        3,
        4,
        5,
    ]  # 5 saves 10% on 4 only at the margin
    assert plan.costs_ms == (190.0, 190.0, 190.0, 200.0, 180.0)  # what each runs at costs
    assert plan.width(9) == 9  # beyond the calibrated widths: as it is
    assert padded_rows(1, plan) == 3 and padded_rows(1) == 1 and padded_rows(82, plan) == 88


def test_timing_noise_within_the_margin_pads_nothing():
    plan = WidthPlan.from_costs({1: 100.0, 2: 95.0, 3: 92.0, 4: 120.0})
    assert plan.run_as == (1, 2, 3, 4)


def test_calibration_times_every_width_and_installs_its_plan():
    loaded = load_model("tiny-random:1")
    costs = width_padding.calibrate(loaded.model)
    assert sorted(costs) == list(range(1, width_padding.MAX_WIDTH + 1)) and min(costs.values()) > 0
    plan = width_padding.plan_of(loaded.model)
    assert len(plan.run_as) == width_padding.MAX_WIDTH
    assert all(plan.width(rows) >= rows for rows in range(1, width_padding.MAX_WIDTH + 1))


@pytest.fixture(scope="module")
def padded_and_plain():
    """The same tiny target twice: one running every small step padded to 12 rows."""
    padded, plain = load_model("tiny-random:1"), load_model("tiny-random:1")
    setattr(padded.model, width_padding.WIDTHS_ATTR, WidthPlan((12,) * 12))
    return padded, plain


@pytest.mark.parametrize("k", [0, 1, 4])
def test_padded_steps_change_no_output(padded_and_plain, prompt_ids, k):
    padded, plain = padded_and_plain
    draft = load_model("tiny-random:2")
    widths = []  # the rows each pass of the padded target ran
    hook = padded.model.get_input_embeddings().register_forward_pre_hook(
        lambda _, args: widths.append(args[0].shape[1])
    )
    for sampling in (
        SamplingParams(max_new_tokens=24),
        SamplingParams(max_new_tokens=24, temperature=1.0, seed=5),
    ):
        for prompt in prompt_ids[:4]:
            outputs = [
                SpeculativeGenerator(target, ModelDrafter(draft))
                .generate(prompt, sampling, k=k)
                .token_ids
                for target in (padded, plain)
            ]
            assert outputs[0] == outputs[1], (k, prompt, sampling.temperature)
    hook.remove()
    assert widths and min(widths) >= 12  # every small step ran padded


def test_a_target_worker_tells_drafters_what_its_steps_cost():
    """Through Info over real gRPC: the draft worker's view of the target carries what
    its steps cost as they run (adaptive calls price passes by it); none: empty."""
    from draft_service.target_connections import TargetConnections
    from target_service.config import TargetConfig
    from target_service.server import create_server

    for plan in (WidthPlan((3, 3, 3, 4, 6, 6), (5.0, 5.0, 5.0, 6.5, 7.0, 7.0)), None):
        loaded = load_model("tiny-random:1")
        setattr(loaded.model, width_padding.WIDTHS_ATTR, plan)
        service = create_server(TargetConfig(address="127.0.0.1:0"), loaded)
        service.start()
        try:
            info = TargetConnections().info(f"127.0.0.1:{service.port}", timeout_s=10.0)
        finally:
            service.server.stop(None)
        assert info.step_ms == (plan.costs_ms if plan else ())


def test_step_costs_that_are_not_times_are_ignored():
    """A faulty worker's step costs (zero, negative, not a number) price nothing."""
    from draft_service.target_connections import _step_ms

    assert _step_ms([5.0, 6.5]) == (5.0, 6.5)
    for bad in ([5.0, 0.0], [-1.0], [float("nan")], [float("inf")]):
        assert _step_ms(bad) == ()


# --- kept per host: a restart installs the timings at once; a first start times them later --


@pytest.fixture
def host_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULATIVE_KERNEL_CACHE", str(tmp_path / "host.json"))


def test_timings_are_kept_per_host_and_model(host_cache):
    first = load_model("tiny-random:1")
    assert not width_padding.install_kept(first.model)  # nothing measured yet
    costs = width_padding.calibrate(first.model, max_width=4)
    again = load_model("tiny-random:1")
    assert width_padding.install_kept(again.model)
    assert width_padding.plan_of(again.model) == WidthPlan.from_costs(costs)
    assert not width_padding.install_kept(load_model("tiny-random:1", dtype="bfloat16").model)


def test_calibrating_in_jobs_runs_one_width_per_job(host_cache):
    loaded = load_model("tiny-random:1")
    jobs = []

    def run(fn, *args):
        jobs.append(fn.__name__)
        return fn(*args)

    costs = width_padding.calibrate_in_jobs(loaded.model, run, max_width=5)
    assert jobs.count("_time_width") == 5 and len(costs) == 5
    assert width_padding.plan_of(loaded.model) is not None
    assert width_padding.install_kept(load_model("tiny-random:1").model)


@pytest.mark.parametrize("after", [True, False])
def test_a_target_packs_and_times_after_serving_or_before(host_cache, monkeypatch, after):
    """pack_after_serving: the worker serves with plain linears, then packs them and
    times its widths between requests, and reports the costs in Info; off: it packs
    before it serves. (Models made in code are never packed: the packaged SmolLM2.)"""
    from draft_service.target_connections import TargetConnections
    from model_runtime.cpu_linear import PackedLinear, onednn_available
    from target_service import server
    from target_service.config import TargetConfig
    from tests.polling import wait_until

    if not onednn_available():
        pytest.skip("no oneDNN: nothing is packed")
    loaded = []
    monkeypatch.setattr(
        server, "load_model", lambda *a, **k: loaded.append(load_model(*a, **k)) or loaded[-1]
    )
    config = TargetConfig(address="127.0.0.1:0", model="smollm2-135m", pack_after_serving=after)
    service = server.create_server(config)
    kinds = lambda: {type(m) for m in loaded[0].model.modules()}  # noqa: E731
    assert (torch.nn.Linear in kinds(), PackedLinear in kinds()) == (after, not after)
    service.start()
    try:
        wait_until(lambda: torch.nn.Linear not in kinds(), "linears packed", 30)
        info = lambda: TargetConnections().info(f"127.0.0.1:{service.port}", 10.0)  # noqa: E731
        wait_until(lambda: info().step_ms, "step costs in Info", 30)
        assert width_padding.plan_of(loaded[0].model) is not None
    finally:
        service.server.stop(None)
