"""GPU-shaped costs: the roofline at the datasheets' figures, and the measured pair."""

from __future__ import annotations

import pytest

from planner.gpu_costs import (
    H100,
    L4,
    LLAMA_3_1_8B,
    LLAMA_3_2_1B,
    MEASURED,
    PAIRS,
    pair_costs,
    roofline_ms,
    with_gpu_costs,
)


def test_a_narrow_pass_streams_the_weights_once():
    # 8.03e9 parameters x 2 bytes over 3.35 TB/s
    assert roofline_ms(LLAMA_3_1_8B, H100, rows=1, tokens=1, context=0) == pytest.approx(
        4.794, 1e-3
    )
    # the same 1B draft on an L4 streams 2.48 GB at 300 GB/s
    assert roofline_ms(LLAMA_3_2_1B, L4, 1, 1, 0) == pytest.approx(8.267, 1e-3)


def test_a_wide_pass_turns_compute_bound():
    # 2 x 8.03e9 FLOPs a token at 989 TFLOPS: past ~295 tokens a pass costs its compute
    knee = LLAMA_3_1_8B.weight_bytes / H100.hbm_bytes_per_s * H100.bf16_flops_per_s
    knee /= LLAMA_3_1_8B.flops_per_token
    assert 290 < knee < 300
    assert roofline_ms(LLAMA_3_1_8B, H100, 1, 1000, 0) == pytest.approx(
        1000 * 16.06e9 / 989e12 * 1e3
    )


def test_each_session_adds_its_kv_cache_read():
    # 32 layers x 2 x 8 KV heads x 128 x 2 bytes = 128 KiB a token
    assert LLAMA_3_1_8B.kv_bytes_per_token == 131072
    one, two = (roofline_ms(LLAMA_3_1_8B, H100, rows, rows, 1000) for rows in (1, 2))
    assert two - one == pytest.approx(1000 * 131072 / 3.35e12 * 1e3)


def test_a_pair_s_costs_file_matches_the_roofline(make_costs):
    costs = with_gpu_costs(
        make_costs(request={"prompt_tokens": 512, "new_tokens": 128}), "llama-8b-h100+llama-1b-l4"
    )
    context = 512 + 64
    for rows in (1, 16, 64):
        assert costs.target.pass_ms(rows, rows * 5) == pytest.approx(
            roofline_ms(LLAMA_3_1_8B, H100, rows, rows * 5, context)
        )
    assert costs.target.pass_ms(1, 1, 4000) == pytest.approx(4001 * 16.06e9 / 989e12 * 1e3)
    assert costs.draft.step_ms(16) == pytest.approx(roofline_ms(LLAMA_3_2_1B, L4, 16, 16, context))
    assert costs.draft.step_ms(1, colocated=True) < costs.draft.step_ms(1)  # on the H100
    assert costs.target.max_sessions == 8  # kept from the file
    assert "datasheet" in costs.target.source and "assumed" not in costs.draft.source


def test_tensor_parallel_divides_a_pass():
    target, _ = pair_costs("llama-70b-4xh100+llama-1b-l4", 512, 128)
    assert target.base_ms == pytest.approx(70.6e9 * 2 / (4 * 3.35e12) * 1e3)


def test_the_measured_pair_cites_its_run():
    target, draft = pair_costs(MEASURED, 128, 64)
    assert target.base_ms == pytest.approx(19.24) and draft.step_ms(8) == 17.5
    assert "results/gpu.md" in target.source


def test_an_unknown_pair_is_refused():
    with pytest.raises(ValueError, match="no GPU pair"):
        pair_costs("llama-8b-tpu", 1, 1)
    assert "llama-8b-h100+llama-1b-l4" in PAIRS
