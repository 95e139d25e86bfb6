"""Construction and the process entry point of the target worker."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from foundation.errors import SpeculativeError
from model_runtime import cpu_linear, static_passes, tensor_parallel, warmup, width_padding
from model_runtime.host_memory import fix_mmap_threshold
from model_runtime.loading import LoadedModel, configure_threads, load_model, resolve_dtype
from model_runtime.step_scheduler import StepScheduler
from service_common import server as common_server
from service_common import telemetry
from service_common.config import parse
from service_common.convert import model_info
from service_common.logs import configure_logging
from service_common.registry import create_worker_service
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.admission import Admission
from target_service.config import ENV_PREFIX, TargetConfig
from target_service.servicer import TargetServicer
from target_service.sessions import TargetSessions

log = logging.getLogger(__name__)

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name[
    "TargetService"
].full_name  # "specdec.v1.TargetService"


def create_server(
    config: TargetConfig, loaded_model: LoadedModel | None = None
) -> common_server.Service:
    """Builds (does not start) the server; loads config.model unless a model is given.
    With config.redis_url the worker joins the target pool once it serves."""
    # Sockets opened while the model loads (tensor-parallel ranks open many) must not take the worker's port.
    with common_server.port_held(config.address):
        return _create_server(config, loaded_model)


def _create_server(config: TargetConfig, loaded_model: LoadedModel | None) -> common_server.Service:
    fix_mmap_threshold()  # steps of ever-changing sizes must not fragment the heap
    # The model is loaded, and every forward pass run, on one thread: the step
    # scheduler, which batches the work of all sessions (model_runtime/step_scheduler.py).
    admission = Admission(config.max_running, config.max_queued)
    compute = StepScheduler(
        max_batch_tokens=config.max_batch_tokens,
        name="target-compute",
        expected_jobs=lambda: admission.load().running,
        prefill_share=config.prefill_share,
    )
    compute.run(configure_threads, config.threads)
    dtype = resolve_dtype(config.dtype, config.device, sharded=config.tensor_parallel > 1)
    ranks = (
        _start_ranks(config, dtype) if config.tensor_parallel > 1 and loaded_model is None else None
    )
    if ranks is not None:
        loaded = compute.run(
            tensor_parallel.load_rank_zero,
            config.model,
            device=config.device,
            dtype=dtype,
            ranks=ranks,
        )
    else:
        loaded = loaded_model or compute.run(
            load_model,
            config.model,
            device=config.device,
            dtype=dtype,
            device_map=config.device_map or None,
            row_invariant=_row_invariant_mode(config),
            defer_packing=config.pack_after_serving,
        )
    compute.model = loaded.model
    _install_static_passes(config, loaded, ranks, compute)
    # Packing and timing widths (CPU): after SERVING where they cannot be kept or were not.
    pack_later = loaded.packing_deferred and loaded_model is None
    # Its own model on a CPU, one process (ranks would have to agree on every step's padding).
    time_widths = (
        config.calibrate_widths
        and loaded_model is None
        and loaded.device.type == "cpu"
        and ranks is None
    )
    if time_widths and not pack_later and width_padding.install_kept(loaded.model):
        time_widths = False
    if warmup.pays_off(loaded):
        log.info("warmed up in %.2f s", compute.run(warmup.warm_up, loaded) * 1e-9)
    servicer = TargetServicer(
        TargetSessions(loaded, config.max_sessions, config.max_cached_tokens, compute),
        worker_id=config.resolved_worker_id(),
        model_info=model_info(
            loaded,
            describe_device(loaded, config.tensor_parallel),
            width_padding.step_costs(loaded.model),
        ),
        default_max_new_tokens=config.default_max_new_tokens,
        admission=admission,
    )
    # A stream's next message (a Decode token, a stretch token, the verdict on a proposal
    # already received) is computed while gRPC sends the last one.
    servicer.Decode = common_server.read_ahead(servicer.Decode)
    servicer.Verify = common_server.read_ahead(servicer.Verify)
    service = create_worker_service(
        config,
        lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s),
        SERVICE_NAME,
        common_pb2.WORKER_POOL_TARGET,
        lambda: servicer.Info(common_pb2.InfoRequest(), None),
        # A thread per call running or queued, besides the sessions' other calls.
        max_calls=max(config.max_sessions, config.max_running + config.max_queued),
    )
    servicer.worker_address = config.resolved_advertise_address(service.port)
    if pack_later or time_widths:
        service.on_started.append(
            lambda: _finish_in_background(loaded, compute, servicer, pack_later, time_widths)
        )
    if ranks is not None:
        service.on_stopped.append(ranks.close)
    return service


def _finish_in_background(
    loaded: LoadedModel,
    compute: StepScheduler,
    servicer: TargetServicer,
    pack: bool,
    time_widths: bool,
) -> None:
    """While serving, between the steps of its requests: packs the model's linears
    (model_runtime/cpu_linear.py), then installs the host's kept width timings or times
    the widths (model_runtime/width_padding.py) and reports the costs in Info."""

    def run() -> None:
        start = time.perf_counter()
        if pack:
            cpu_linear.pack_in_jobs(loaded.model, compute.run)
            log.info("linears packed while serving in %.1f s", time.perf_counter() - start)
        if time_widths and not width_padding.install_kept(loaded.model):
            costs = width_padding.calibrate_in_jobs(loaded.model, compute.run)
            log.info(
                "step widths timed while serving",
                extra={
                    "fields": {
                        "ms_by_width": {w: round(c, 1) for w, c in costs.items()},
                        "run_as": width_padding.plan_of(loaded.model).run_as,
                    }
                },
            )
        servicer.model_info = model_info(
            loaded, servicer.model_info.device, width_padding.step_costs(loaded.model)
        )
        log.info("start-up finished while serving in %.1f s", time.perf_counter() - start)

    threading.Thread(target=run, name="finish-start", daemon=True).start()


def _row_invariant_mode(config: TargetConfig) -> str:
    """Row invariance as set, but auto yields to static passes asked for by name (the two
    do not run together: per-row attention is not a fixed shape)."""
    if config.row_invariant == "auto" and config.static_passes == static_passes.ON:
        return "off"
    return config.row_invariant


def _install_static_passes(
    config: TargetConfig, loaded: LoadedModel, ranks, compute: StepScheduler
) -> None:
    """Fixed-shape passes where the setting and the model allow: not with row invariance
    (per-row attention) nor tensor parallelism (the ranks run eager)."""
    blocked = (
        "row invariance"
        if loaded.row_invariance is not None
        else "tensor parallelism"
        if ranks is not None or config.tensor_parallel > 1
        else None
    )
    if blocked and config.static_passes == static_passes.ON:
        raise SpeculativeError(f"--static-passes on does not run with {blocked}: turn one off")
    if not blocked:
        compute.run(
            static_passes.install,
            loaded.model,
            config.static_passes,
            config.static_slots,
            min(config.static_capacity, loaded.context_length),
        )


def _start_ranks(config: TargetConfig, dtype: str) -> tensor_parallel.Ranks:
    """Ranks 1..N-1; one that exits stops this worker (SIGTERM to itself: health NOT_SERVING,
    out of the registry, calls in flight failing over), which then exits with status 1."""
    if config.device_map:
        raise SpeculativeError(
            "--tensor-parallel and --device-map are two ways to shard a model: choose one"
        )

    def lost(rank: int, status: int) -> None:
        _LOST_RANKS.append(rank)
        os.kill(os.getpid(), signal.SIGTERM)

    if (
        config.tensor_parallel_local
        and config.tensor_parallel_local < config.tensor_parallel
        and not config.tensor_parallel_port
    ):
        raise SpeculativeError("ranks on other nodes need a fixed --tensor-parallel-port to dial")
    return tensor_parallel.Ranks(
        config.tensor_parallel,
        config.model,
        config.device,
        dtype,
        config.threads,
        lost,
        config.tensor_parallel_local,
        config.tensor_parallel_master,
        config.tensor_parallel_port,
    )


_LOST_RANKS: list[int] = []  # ranks of this process's tensor-parallel worker that exited


def describe_device(loaded: LoadedModel, tensor_parallel_ranks: int = 1) -> str:
    """ "cpu", "cuda:0", for a model sharded by accelerate e.g. "cuda:0-3", and by tensor
    parallelism "cuda:0-3 (tensor parallel)" or "cpu x2 (tensor parallel)"."""
    if tensor_parallel_ranks > 1:
        device = loaded.device.type
        places = (
            f"cuda:0-{tensor_parallel_ranks - 1}"
            if device == "cuda"
            else f"{device} x{tensor_parallel_ranks}"
        )
        return f"{places} (tensor parallel)"
    device_map = getattr(loaded.model, "hf_device_map", None)
    if not device_map:
        return str(loaded.device)
    places = set(device_map.values())
    if all(isinstance(p, int) for p in places):  # GPU indices
        low, high = min(places), max(places)
        if len(places) == high - low + 1:
            return f"cuda:{low}" if low == high else f"cuda:{low}-{high}"
    return ",".join(sorted(f"cuda:{p}" if isinstance(p, int) else str(p) for p in places))


def main(argv: list[str] | None = None) -> int:
    config = parse(
        TargetConfig, ENV_PREFIX, argv, description="The target worker: specdec.v1.TargetService."
    )
    configure_logging("target", config.log_level)
    log.info(
        "loading model",
        extra={
            "fields": {
                "model": config.model,
                "device": config.device_map or config.device,
                "dtype": resolve_dtype(
                    config.dtype, config.device, sharded=config.tensor_parallel > 1
                ),
                "tensor_parallel": config.tensor_parallel,
            }
        },
    )
    try:
        telemetry.setup("target", config, config.resolved_worker_id())
        service = create_server(config)
    except (SpeculativeError, OSError) as error:
        log.error("cannot start: %s", error)
        return 2
    # One parseable line for launchers: the bound port (address ":0" picks a free one).
    log.info(
        "serving",
        extra={
            "fields": {
                "address": config.address,
                "port": service.port,
                "worker_id": config.resolved_worker_id(),
                "advertise_address": config.resolved_advertise_address(service.port),
            }
        },
    )
    service.serve_until_signalled(config.grace_s)
    telemetry.current().shutdown()  # flushes the spans still buffered
    if _LOST_RANKS:  # a thread may still wait in a collective with the dead rank: leave at once
        log.error("stopped: tensor-parallel rank %d was lost", _LOST_RANKS[0])
        os._exit(1)
    log.info("stopped")
    return 0
