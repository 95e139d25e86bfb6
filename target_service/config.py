"""Configuration of the target worker: flags `--model`, `--max-sessions`, ... and the
environment variables `TARGET_MODEL`, `TARGET_MAX_SESSIONS`, ... (flags win)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from service_common.options import RegistryConfig, ServerConfig, TelemetryConfig
from service_common.server import advertised_address, default_worker_id

ENV_PREFIX = "TARGET"


def _option(default, help_text: str):
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclass
class TargetConfig(ServerConfig, RegistryConfig, TelemetryConfig):
    # All interfaces, the conventional first gRPC port; ":0" binds a free port (tests).
    address: str = _option(
        "0.0.0.0:50051", "host:port to listen on; port 0 picks a free port (logged)"
    )
    # The packaged SmolLM2-135M runs anywhere without a download; a real deployment
    # names a large model.
    model: str = _option(
        "smollm2-135m", "packaged name, .gguf path, Hugging Face id or tiny-random[:SEED]"
    )
    # CPU always exists; "cuda" / "cuda:1" on a GPU host.
    device: str = _option("cpu", "cpu, cuda, cuda:1, ...")
    # auto: bfloat16 on a GPU and on a CPU with AMX (with row invariance as exact as
    # fp32 there, and about 1.35x faster a token: benchmarks/results/archive/results_bf16_qwen.md),
    # float32 elsewhere (model_runtime.loading.resolve_dtype).
    dtype: str = _option("auto", "auto, float32, bfloat16 or float16")
    # Every row's logits the same bits whatever the pass (width, batch, place), so that
    # speculation cannot flip a near-tied greedy token (model_runtime/row_invariance.py).
    # auto: on in half precision on a CPU, where near-ties flip (its price per host:
    # docs/exactness.md); off in fp32 (1.2-2x a step for last-bit differences) and on
    # GPUs until priced there.
    row_invariant: str = _option(
        "auto",
        "auto, on or off: rows computed the same whatever the pass "
        "(exact greedy speculation by construction)",
    )
    # Passes of fixed shapes over KV memory allocated up front, replayed as CUDA graphs
    # (model_runtime/static_passes.py): a GPU pass then costs its weights, not its kernel
    # launches. auto: on with CUDA (not with row invariance or tensor parallelism), off on
    # a CPU, where the eager path is faster (docs/batching.md).
    static_passes: str = _option(
        "auto", "auto, on or off: fixed-shape passes, CUDA graphs on a GPU"
    )
    # Sessions whose caches the pool holds (more run eager) and their length: for a
    # 7B-shaped bf16 model 57 KiB a token, 33 x 4096 tokens = 7.4 GiB allocated at start.
    static_slots: int = _option(32, "sessions the static passes' KV pool holds")
    static_capacity: int = _option(
        4096, "tokens a session holds in the static KV pool (longer: eager)"
    )
    # None = the whole model on `device`; "auto" shards one model across all GPUs of
    # the host with accelerate (overrides device).
    device_map: str | None = _option(
        None, "'auto' shards the model across the host's GPUs (accelerate)"
    )
    # One worker over N GPUs (or N CPU processes): each layer split across them
    # (model_runtime/tensor_parallel.py); for a target that does not fit one device.
    tensor_parallel: int = _option(
        1, "ranks the model is sharded over (tensor parallelism); rank r on cuda:r"
    )
    # Beyond one node (a LeaderWorkerSet group): this worker starts ranks 0..L-1 here,
    # the other nodes theirs (python -m model_runtime.tensor_parallel --node-index I).
    # 0: every rank here (one node).
    tensor_parallel_local: int = _option(
        0, "tensor-parallel ranks on this node (0 = all: one node)"
    )
    # Where the other nodes' ranks dial rank 0 (this pod's address) and on which port;
    # one node: loopback and a free port.
    tensor_parallel_master: str = _option(
        "127.0.0.1", "this worker's address as other nodes' ranks dial it"
    )
    tensor_parallel_port: int = _option(
        0, "rank 0's rendezvous port (0 = a free one: one node only)"
    )
    # Empty = f"target-{hostname}-{pid}": unique per process, stable for its lifetime.
    worker_id: str = _option("", "id in KV-cache handles; empty = target-HOSTNAME-PID")
    # Other workers must reach this one (e.g. the pod IP in Kubernetes); empty = derived
    # from `address`, with the hostname for a wildcard host.
    advertise_address: str = _option(
        "", "host:port other workers use to reach this one; empty = derived"
    )
    # Sessions whose KV caches are held at once; the least recently used is evicted
    # (its owner re-prefills it) when a new one needs room.
    max_sessions: int = _option(64, "sessions held at once (least recently used evicted)")
    # KV cache budget summed over sessions, in tokens: 64 sessions of 4 Ki tokens. For
    # SmolLM2-135M in fp32 that is 256 Ki * (30 layers * 2 * 3 kv heads * 64 * 4 bytes)
    # = 11.25 GiB; size it to the host's memory for other models.
    max_cached_tokens: int = _option(262144, "KV cache budget over all sessions, in tokens")
    # Calls doing model work at once (prefills, Verify and Decode streams): the sessions
    # that share each batched step. A step's time grows with its batch, so this bounds
    # every running session's time per token; 32 keeps SmolLM2-135M on 2 CPU cores
    # under a second per step.
    max_running: int = _option(32, "calls doing model work at once; more wait in a queue")
    # Calls that wait for a running slot (each within its own deadline); past this a
    # call gets RESOURCE_EXHAUSTED at once, so its client can go elsewhere.
    max_queued: int = _option(64, "calls waiting for a running slot; more are refused")
    # Tokens one batched forward pass runs, over all its sessions: room for every
    # running session's largest proposal (32 x (16 + 1) = 544 rounds down to 512 with
    # typical k), prefill chunks filling the rest.
    max_batch_tokens: int = _option(
        512, "tokens per batched forward pass (prefill is chunked to fit)"
    )
    # Stall-free prefill: a running session's time per token stays within 1 + this of
    # what decoding costs; a larger share gives new prompts their first token sooner.
    prefill_share: float = _option(
        0.5,
        "while sessions decode, the most prefill may add to a step, "
        "as a share of its decoding's cost (0: no cap)",
    )
    # Used when a request leaves max_new_tokens at 0: long enough for a paragraph,
    # short enough that a forgotten limit does not hold a worker for minutes.
    default_max_new_tokens: int = _option(256, "max_new_tokens of requests that leave it at 0")
    # On a CPU a pass over a few more rows can cost less (model_runtime/width_padding.py):
    # a few seconds at start to time widths 1-12, then small steps run at the cheapest.
    calibrate_widths: bool = _option(
        True, "time small step widths at start (CPU) and pad steps to the cheapest"
    )
    # oneDNN-packed fp32 linears (model_runtime/cpu_linear.py) cannot be kept between
    # starts and cost a Qwen2.5-Coder-1.5B start 7-10 s: serve first, pack after.
    pack_after_serving: bool = _option(
        True, "pack fp32 CPU linears after SERVING (plain kernels meanwhile); false: before"
    )
    # 0 = torch's default (all cores), which suits a worker that owns its host.
    threads: int = _option(0, "torch CPU threads; 0 = torch's default")
    # Kubernetes sends SIGKILL 30 s after SIGTERM by default.
    grace_s: float = _option(10.0, "seconds in-flight calls get to finish after SIGTERM")
    # INFO logs start-up, evictions and shutdown; DEBUG adds per-call details.
    log_level: str = _option("INFO", "DEBUG, INFO, WARNING or ERROR")

    def resolved_worker_id(self) -> str:
        return self.worker_id or default_worker_id("target")

    def resolved_advertise_address(self, port: int) -> str:
        return advertised_address(self.advertise_address, self.address, port)
