"""Fixed-shape passes over a KV pool (model_runtime/static_passes.py), eager and compiled
by inductor on the CPU (the same code a GPU replays as CUDA graphs): greedy output
equals target-only for every drafter, k and concurrency tested; caches move out of the
pool past its capacity; a compile that fails falls back to eager with the error kept."""

from __future__ import annotations

import pytest
import torch

from foundation.errors import InvalidArgument, SpeculativeError
from model_runtime import static_passes
from model_runtime.batched_forward import Segment, SequenceKV, SlotKV, forward_segments
from model_runtime.loading import load_model
from model_runtime.model_session import ModelSession
from model_runtime.step_scheduler import StepScheduler
from speculative.drafters import ModelDrafter
from speculative.generator import SpeculativeGenerator
from speculative.prompt_lookup import NgramDrafter
from speculative.sampling import SamplingParams
from speculative.target import TargetSession
from target_service.config import TargetConfig
from target_service.server import create_server
from tests.model_runtime.test_step_scheduler import _run_threads

GREEDY = SamplingParams(max_new_tokens=24)


def static_target(slots: int = 4, capacity: int = 256, compile_mode: str | None = None):
    loaded = load_model("tiny-random:1")
    passes = static_passes.StaticPasses(
        loaded.model, static_passes.KVPool(loaded.model, slots, capacity), compile_mode
    )
    setattr(loaded.model, static_passes.STATIC_ATTR, passes)
    return loaded, passes


@pytest.fixture(scope="module")
def static():
    return static_target()


def test_speculation_through_static_passes_equals_target_only(
    static, tiny_target, tiny_perturbed, prompt_ids
):
    loaded, passes = static
    drafters = {"perturbed": ModelDrafter(tiny_perturbed), "ngram": NgramDrafter()}
    for ids in prompt_ids[:8]:
        # the eager path
        reference = SpeculativeGenerator(tiny_target).generate(ids, GREEDY, k=0).token_ids
        assert SpeculativeGenerator(loaded).generate(ids, GREEDY, k=0).token_ids == reference
        for drafter in drafters.values():
            for k in (1, 4, 8):
                assert (
                    SpeculativeGenerator(loaded, drafter).generate(ids, GREEDY, k=k).token_ids
                    == reference
                )
    assert passes.num_static > 100 and passes.failure is None


@pytest.mark.parametrize("sessions", [1, 4, 6])
def test_sessions_sharing_static_steps_equal_target_only(static, tiny_target, prompt_ids, sessions):
    """Steps of 1..6 sessions, rows 1..5 each, bucketed and padded (6 sessions > 4 slots:
    two run with caches of their own, so their steps run eager)."""
    loaded, passes = static
    references = [
        SpeculativeGenerator(tiny_target).generate(ids, GREEDY, k=0).token_ids
        for ids in prompt_ids[:sessions]
    ]
    scheduler = StepScheduler(loaded.model, max_batch_tokens=64)

    def run(index: int) -> list[int]:
        session = TargetSession(loaded, prompt_ids[index], GREEDY, prefill=False)
        scheduler.submit(session.prefill_steps())
        out: list[int] = []
        while len(out) < GREEDY.max_new_tokens:
            size = 1 + (len(out) + index) % 5
            draft = [
                t if (i + index) % 3 else (t + 1) % 256
                for i, t in enumerate(references[index][len(out) :][:size])
            ]
            out += scheduler.submit(session.verify_steps(session.length, draft))[0].token_ids
        session.release()
        return out[: GREEDY.max_new_tokens]

    static_before = passes.num_static
    try:
        assert _run_threads([lambda i=i: run(i) for i in range(sessions)]) == references
    finally:
        scheduler.stop()
    assert passes.num_static > static_before
    assert len(passes.pool._free) == passes.pool.num_slots  # every slot given back


def test_a_cache_leaves_the_pool_past_its_capacity_and_stays_right(tiny_target):
    loaded, passes = static_target(slots=2, capacity=40)
    prompt = list(range(30, 60))
    reference = SpeculativeGenerator(tiny_target).generate(prompt, GREEDY, k=0).token_ids
    session = ModelSession(loaded.model, 1024)
    assert isinstance(session._kv, SlotKV)
    result = SpeculativeGenerator(loaded, NgramDrafter()).generate(prompt, GREEDY, k=4).token_ids
    assert result == reference
    assert len(passes.pool._free) == 2 and passes.num_eager > 0  # the long part ran eager


def test_a_full_pool_leaves_a_session_its_own_cache(tiny_target):
    loaded, passes = static_target(slots=1)
    kv_a, kv_b = passes.pool.new_kv(), passes.pool.new_kv()
    key = torch.zeros(2, 3, 16)
    kv_a.write(0, 0, key, key)
    kv_b.write(0, 0, key, key)
    assert kv_a.slot == 0 and kv_b.slot is None and kv_b.capacity() >= 3
    kv_a.clear()
    assert passes.pool._free == [0]
    assert isinstance(SequenceKV(), SequenceKV)


def test_a_failing_compile_runs_eager_with_the_error_kept(tiny_target, prompt_ids, monkeypatch):
    loaded, passes = static_target()

    def broken(*args):
        raise RuntimeError("capture failed: an unsupported operation")

    passes._step = broken
    reference = SpeculativeGenerator(tiny_target).generate(prompt_ids[0], GREEDY, k=0).token_ids
    assert (
        SpeculativeGenerator(loaded, NgramDrafter()).generate(prompt_ids[0], GREEDY, k=4).token_ids
        == reference
    )
    assert passes.failure == "RuntimeError: capture failed: an unsupported operation"
    assert passes._step == passes._eager_step and passes.num_static > 0


def test_compiled_passes_equal_target_only(tiny_target, tiny_perturbed, prompt_ids):
    """inductor on the CPU: the code a GPU captures as CUDA graphs (two shapes here)."""
    loaded, passes = static_target(compile_mode="inductor")
    for ids in prompt_ids[:2]:
        reference = SpeculativeGenerator(tiny_target).generate(ids, GREEDY, k=0).token_ids
        result = SpeculativeGenerator(loaded, ModelDrafter(tiny_perturbed)).generate(
            ids, GREEDY, k=3
        )
        assert result.token_ids == reference
    assert passes.failure is None and passes.num_static > 10


def test_the_setting():
    model = load_model("tiny-random:1").model
    with pytest.raises(InvalidArgument, match="auto, on, off"):
        static_passes.install(model, "always", 2, 64)
    assert static_passes.install(model, "auto", 2, 64) is None  # a CPU: the eager path
    # a CPU: eager static passes
    assert static_passes.install(model, "on", 2, 64).compile_mode is None


def test_a_target_refuses_static_passes_with_row_invariance():
    with pytest.raises(SpeculativeError, match="does not run with row invariance"):
        create_server(
            TargetConfig(
                address="127.0.0.1:0",
                model="tiny-random:1",
                row_invariant="on",
                static_passes="on",
                calibrate_widths=False,
            )
        )


@pytest.mark.parametrize("name", ["tiny-random:1", "random:qwen2-tiny:0"])
def test_the_fixed_shape_step_is_one_graph_with_no_read_back(name):
    """Traced whole (fullgraph: a graph break, a tensor read back to the host or a
    branch on a value fails it): what a CUDA graph capture needs, checked on the CPU
    for a Llama and a Qwen2 model."""
    loaded = load_model(name)
    passes = static_passes.StaticPasses(
        loaded.model, static_passes.KVPool(loaded.model, 2, 64), None
    )
    setattr(loaded.model, static_passes.STATIC_ATTR, passes)
    passes._step = torch.compile(passes._eager_step, fullgraph=True, dynamic=False)
    kv = passes.pool.new_kv()
    eager = forward_segments(
        loaded.model, [Segment(kv, 0, list(range(1, 11)), 1)]
    )  # takes the slot
    assert passes.num_static == 0 and kv.slot is not None and eager[0].shape[0] == 1
    forward_segments(loaded.model, [Segment(kv, 10, [3, 4, 5], 3)])
    assert passes.num_static == 1 and passes.failure is None


def test_a_greedy_draft_chain_on_the_device_proposes_what_single_passes_propose(
    tiny_target, tiny_perturbed, prompt_ids
):
    """The draft's k passes back to back with one read back (on a GPU, CUDA graphs fed on
    the device): the same proposals, the same cache after, as k single passes; and the
    speculative output stays target-only's."""
    draft = ModelDrafter(load_model("tiny-random:1"))  # the same weights, eager single passes
    chained_model, passes = static_target()
    passes.device_loop = True  # as on a GPU
    chained = ModelDrafter(chained_model)
    for ids in prompt_ids[:6]:
        plain_session, chain_session = draft.open(ids, GREEDY), chained.open(ids, GREEDY)
        for session in (plain_session, chain_session):
            session.prefill()
        for k, keep in ((4, 2), (3, 3), (6, 0), (2, 1)):
            base = plain_session.length
            one, other = plain_session.propose(k), chain_session.propose(k)
            assert one.token_ids == other.token_ids
            # a verdict: keep some, append a correction
            for session in (
                plain_session,
                chain_session,
            ):
                session.truncate_to(base + keep)
                session.append([7])
        assert chain_session.session.cached_length == plain_session.session.cached_length
    assert passes.num_static > 20
    reference = SpeculativeGenerator(tiny_target).generate(prompt_ids[0], GREEDY, k=0).token_ids
    assert (
        SpeculativeGenerator(tiny_target, chained).generate(prompt_ids[0], GREEDY, k=5).token_ids
        == reference
    )


def test_workers_with_static_passes_serve_exact_output_through_the_services(
    tiny_target, prompt_ids
):
    """Real processes: target and draft workers with `--static-passes on` (eager fixed
    shapes on a CPU, the code a GPU replays), four sessions at once, every drafter and k:
    each output equals target-only in process."""
    import concurrent.futures

    from specdec.v1 import common_pb2, orchestrator_pb2
    from tests.local_system import LocalSystem

    system = LocalSystem("tiny-random:1", "tiny-random:1")
    for role in system.roles:
        if role.pool in ("target", "draft"):
            role.args += [
                "--static-passes",
                "on",
                "--static-slots",
                "8",
                "--static-capacity",
                "256",
            ]

    def generate(ids, k: int, drafter: str) -> list[int]:
        request = orchestrator_pb2.GenerateRequest()
        request.token_ids.ids.extend(ids)
        request.sampling.max_new_tokens = GREEDY.max_new_tokens
        request.speculation.CopyFrom(
            common_pb2.SpeculationParams(num_speculative_tokens=k, drafter=drafter)
        )
        return list(system.stub.Generate(request, timeout=120).token_ids)

    prompts = prompt_ids[:4]
    references = [
        SpeculativeGenerator(tiny_target).generate(ids, GREEDY, k=0).token_ids for ids in prompts
    ]
    with system, concurrent.futures.ThreadPoolExecutor(4) as pool:
        for k, drafter in ((0, "model"), (4, "model"), (3, "ngram"), (5, "ngram+model")):
            outputs = list(pool.map(lambda ids, k=k, d=drafter: generate(ids, k, d), prompts))
            assert outputs == references, (k, drafter)
        # both workers ran them
        assert system.logs().count("static passes: 8 slots of 256 tokens") == 2
