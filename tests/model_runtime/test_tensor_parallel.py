"""A target worker sharded over 2 ranks (real processes, gloo, fp32 tiny Llama- and
Qwen2-shaped models) through the real services: its output equals the single-process
target's, greedy and seeded sampled; a rank SIGKILLed mid-stream takes its worker out,
the call fails over with nothing lost, and no process of the dead worker is left."""

from __future__ import annotations

import concurrent.futures
import os
import signal
from pathlib import Path

import pytest

from foundation.errors import InvalidArgument
from model_runtime.loading import load_model
from specdec.v1 import common_pb2, orchestrator_pb2
from speculative.generator import SpeculativeGenerator
from speculative.sampling import SamplingParams
from tests.local_system import LocalSystem
from tests.polling import wait_until

PROMPTS = [
    [5, 17, 99, 3, 42, 8],
    [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100],
    [1, 2, 3, 1, 2, 3, 1, 2],
]
MAX_NEW_TOKENS = 24
SPECULATION = {"k=0": (0, False), "k=1": (1, False), "k=4": (4, False), "adaptive": (4, True)}
MODELS = {
    "llama": ("tiny-random:1", "tiny-random:2"),
    "qwen2": ("random:qwen2-tiny:1", "random:qwen2-tiny:2"),
}


def _request(
    ids,
    k: int,
    adaptive: bool = False,
    sampled_seed: int | None = None,
    session_id: str = "",
    max_new_tokens: int = MAX_NEW_TOKENS,
):
    request = orchestrator_pb2.GenerateRequest(session_id=session_id, include_stats=True)
    request.token_ids.ids.extend(ids)
    request.sampling.max_new_tokens = max_new_tokens
    if sampled_seed is not None:
        request.sampling.temperature, request.sampling.seed = 1.0, sampled_seed
    request.speculation.CopyFrom(
        common_pb2.SpeculationParams(num_speculative_tokens=k, drafter="model", adaptive=adaptive)
    )
    return request


def _target_only(loaded, ids, max_new_tokens=MAX_NEW_TOKENS) -> list[int]:
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(loaded.eos_token_id,))
    return SpeculativeGenerator(loaded).generate(list(ids), params, k=0).token_ids


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request):
    """(the single-process target in this process, a system whose target has 2 ranks),
    for one model shape."""
    target_model, draft_model = MODELS[request.param]
    with LocalSystem(target_model, draft_model, tensor_parallel=2) as sharded:
        yield load_model(target_model), sharded


@pytest.fixture(scope="module")
def qwen2_systems():
    """Qwen2-shaped: a system whose target has 2 ranks, and one whose target is one process."""
    with (
        LocalSystem(*MODELS["qwen2"], tensor_parallel=2) as sharded,
        LocalSystem(*MODELS["qwen2"]) as single,
    ):
        yield sharded, single


@pytest.mark.parametrize("speculation", list(SPECULATION))
def test_greedy_through_a_sharded_target_equals_the_single_process_target(pair, speculation):
    loaded, sharded = pair
    k, adaptive = SPECULATION[speculation]
    for prompt in PROMPTS:
        response = sharded.stub.Generate(_request(prompt, k, adaptive), timeout=60)
        assert list(response.token_ids) == _target_only(loaded, prompt), (speculation, prompt)


def test_concurrent_sessions_batched_on_a_sharded_target_equal_the_single_process_target(pair):
    loaded, sharded = pair
    prompts = [
        [index + 1, *prompt] for index in range(3) for prompt in PROMPTS
    ]  # 9 sessions in the steps at once

    def generate(prompt):
        return list(sharded.stub.Generate(_request(prompt, 4), timeout=120).token_ids)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as executor:
        outputs = list(executor.map(generate, prompts))
    assert outputs == [_target_only(loaded, prompt) for prompt in prompts]


@pytest.mark.parametrize("k", [0, 4])
def test_a_seeded_sampled_call_draws_what_the_single_process_target_draws(qwen2_systems, k):
    sharded, single = qwen2_systems
    for seed in (3, 11):
        request = _request(PROMPTS[0], k, sampled_seed=seed)
        drawn = list(sharded.stub.Generate(request, timeout=60).token_ids)
        assert drawn == list(single.stub.Generate(request, timeout=60).token_ids), seed
    runs = {
        tuple(sharded.stub.Generate(_request(PROMPTS[0], k, sampled_seed=s), timeout=60).token_ids)
        for s in (3, 4)
    }
    assert len(runs) == 2  # the seed matters: the comparison above can fail


def test_the_worker_reports_its_ranks(pair):
    _, sharded = pair
    workers = sharded.stub.ListWorkers(orchestrator_pb2.ListWorkersRequest(), timeout=10).workers
    target = next(w for w in workers if w.pool == common_pb2.WORKER_POOL_TARGET)
    assert target.model.device == "cpu x2 (tensor parallel)"


def test_heads_that_do_not_split_evenly_are_refused_before_serving():
    from model_runtime import tensor_parallel

    loaded = load_model("tiny-random:1")  # 4 heads, 2 key-value heads
    tensor_parallel.check_shardable(loaded.model, 2)
    with pytest.raises(
        InvalidArgument, match="must divide the model's 4 attention heads and 2 key-value heads"
    ):
        tensor_parallel.check_shardable(loaded.model, 4)


# --- a rank lost ------------------------------------------------------------------------


def _ranks_of(pid: int) -> list[int]:
    """Live processes whose parent is pid and that run a tensor-parallel rank."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        parent = int(
            next(line for line in status.splitlines() if line.startswith("PPid:")).split()[1]
        )
        if (
            parent == pid
            and b"model_runtime.tensor_parallel" in command
            and "State:\tZ" not in status
        ):
            found.append(int(entry.name))
    return found


def test_a_rank_sigkilled_mid_stream_stops_its_worker_and_the_call_fails_over(tiny_target):
    from tests.redis_server import RedisServer

    redis_server = RedisServer().start()
    try:
        with LocalSystem(
            redis_url=redis_server.url,
            target_workers=2,
            tensor_parallel=2,
            heartbeat_s=0.5,
            heartbeat_ttl_s=2.0,
        ) as system:
            wait_until(lambda: _target_count(system) == 2, "both sharded targets in the registry")
            first = system.stub.Generate(_request(PROMPTS[0][:3], 4, max_new_tokens=2), timeout=30)
            session = system.stub.GetSession(
                orchestrator_pb2.GetSessionRequest(session_id=first.session_id)
            )
            victim = system.process(system.role(session.target.worker_address).name)
            ranks = _ranks_of(victim.pid)
            assert len(ranks) == 1, ranks
            history = [*PROMPTS[0][:3], *first.token_ids, *PROMPTS[0][3:]]
            tokens, stats = [], None
            request = _request(PROMPTS[0][3:], 4, session_id=first.session_id, max_new_tokens=120)
            for chunk in system.stub.GenerateStream(request, timeout=60):
                tokens.extend(chunk.token_ids)
                if tokens and stats is None and os.path.exists(f"/proc/{ranks[0]}"):
                    os.kill(ranks[0], signal.SIGKILL)
                stats = chunk.stats if chunk.HasField("stats") else stats
            assert tokens == _target_only(tiny_target, history, 120)  # none lost, none repeated
            assert stats.num_failovers >= 1, "the rank was killed after the generation ended"
            victim.wait(timeout=30)  # the worker stopped itself, out of the pool
            assert victim.returncode == 1
            assert not _alive(ranks[0])
            wait_until(lambda: _target_count(system) == 1, "the stopped worker out of the registry")
            # Rank 0 SIGKILLed: its other ranks die with it.
            survivor = next(
                system.process(r.name)
                for r in system.roles
                if r.pool == "target" and system.process(r.name).poll() is None
            )
            orphans = _ranks_of(survivor.pid)
            os.kill(survivor.pid, signal.SIGKILL)
            wait_until(
                lambda: not any(_alive(pid) for pid in orphans),
                f"ranks {orphans} gone with their rank 0",
            )
    finally:
        redis_server.cleanup()


def _alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _target_count(system) -> int:
    workers = system.stub.ListWorkers(orchestrator_pb2.ListWorkersRequest(), timeout=10).workers
    return sum(w.pool == common_pb2.WORKER_POOL_TARGET for w in workers)


def test_a_target_over_two_nodes_equals_the_single_process_target():
    """Beyond one node: the worker runs rank 0 only (--tensor-parallel-local 1), and a
    second 'node' (here another process on loopback, as a LeaderWorkerSet worker pod
    runs it) starts rank 1 with --node-index 1, dialing the worker's rendezvous port."""
    import subprocess
    import sys

    from launcher.cluster import free_port

    target_model, draft_model = MODELS["qwen2"]
    port = free_port()
    node = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "model_runtime.tensor_parallel",
            "--node-index",
            "1",
            "--local-ranks",
            "1",
            "--world-size",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--port",
            str(port),
            "--model",
            target_model,
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--threads",
            "1",
        ]
    )
    try:
        system = LocalSystem(target_model, draft_model, tensor_parallel=2)
        target = next(role for role in system.roles if role.pool == "target")
        target.args += ["--tensor-parallel-local", "1", "--tensor-parallel-port", str(port)]
        with system:
            loaded = load_model(target_model)
            for prompt in PROMPTS:
                response = system.stub.Generate(_request(prompt, 4), timeout=60)
                assert list(response.token_ids) == _target_only(loaded, prompt)
        node.wait(timeout=30)  # its rank ends with the worker (rank 0's sockets close)
    finally:
        if node.poll() is None:
            node.kill()
        node.wait()


def test_a_node_outside_the_group_is_refused():
    from model_runtime import tensor_parallel

    with pytest.raises(SystemExit, match="outside --world-size"):
        tensor_parallel.main(
            [
                "--node-index",
                "2",
                "--local-ranks",
                "1",
                "--world-size",
                "2",
                "--port",
                "1",
                "--model",
                "m",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--threads",
                "1",
            ]
        )
