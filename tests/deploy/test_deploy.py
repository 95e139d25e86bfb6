"""The deployment files, checked offline (deploy/validate.py does the work):

- every kustomize overlay renders with a real kustomize and each object validates against
  the Kubernetes schemas; the compose file against the compose specification; the
  Dockerfile passes hadolint; and each check fails on a deliberately broken fixture;
- the variables and flags the manifests and the compose file set are fields of the
  services' config dataclasses (imported, so the files cannot drift from the code);
- the local launcher and the compose file start the same roles with the same settings;
- the manifests have what the deployment guide promises (probes, headless worker
  Services, HPAs on the sessions gauge and, for the target, on calls per running slot,
  for the draft on its draft-to-verify time ratio, each served by a prometheus-adapter
  rule, PDBs, drain time, AOF Redis, GPU requests).
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
import time
import typing
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deploy"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


validate = _load("deploy_validate", REPO_ROOT / "deploy" / "validate.py")
healthcheck = _load("deploy_healthcheck", REPO_ROOT / "deploy" / "healthcheck.py")

OVERLAYS = {path.name: path for path in validate.overlays()}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: validate.render(path) for name, path in OVERLAYS.items()}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(validate.COMPOSE_FILE.read_text())


def objects_of(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def role_container(objects: list[dict], role: str) -> tuple[dict, dict]:
    """(pod spec, container) of the role's Deployment."""
    deployment = objects_of(objects, "Deployment")[f"specdec-{role}"]
    pod = deployment["spec"]["template"]["spec"]
    return pod, next(c for c in pod["containers"] if c.get("args", [None])[0] == role)


def role_settings(objects: list[dict], role: str):
    return next(s for s in validate.k8s_settings(objects) if s.role.name == role)


# ---------------------------------------------------------------- the validators, and that they can fail


def test_every_overlay_exists():
    assert set(OVERLAYS) == {"cpu", "gpu", "gpu-tensor-parallel", "gpu-multinode"}


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "gpu-tensor-parallel"])
def test_overlay_renders_and_validates(overlay):
    assert validate.check_overlay(OVERLAYS[overlay]) == []


def test_compose_file_validates():
    assert validate.check_compose() == []


def test_dockerfile_passes_hadolint():
    assert validate.hadolint_errors(validate.DOCKERFILE) == []


def test_validation_command_passes(capsys):
    assert validate.main([]) == 0
    assert "FAIL" not in capsys.readouterr().out


def test_broken_manifest_fails_every_check():
    errors = "\n".join(validate.check_overlay(FIXTURES / "broken-overlay"))
    assert "'grpcc' was unexpected" in errors  # strict schema: unknown field
    assert "'sixteen' is not of type 'integer'" in errors  # schema: wrong type
    assert "TARGET_MODLE is not read by target" in errors  # settings: not a field
    assert "DRAFT_DEFAULT_K belongs to another role" in errors
    assert "TARGET_MAX_SESSIONS='lots' is not a int" in errors  # settings: value type
    assert "terminationGracePeriodSeconds 20 <= preStop 5 s + grace_s 25 s" in errors
    assert len(errors.splitlines()) == 6


def test_broken_kustomization_fails_to_render():
    with pytest.raises(validate.RenderError, match="no-such-file.yaml"):
        validate.render(FIXTURES / "missing-resource")
    assert validate.check_overlay(FIXTURES / "missing-resource") != []


def test_broken_compose_file_fails():
    errors = validate.check_compose(FIXTURES / "broken-compose.yml")
    text = "\n".join(errors)
    assert "'enviroment' were unexpected" in text or "'enviroment' was unexpected" in text
    assert "service_ready" in text
    assert "DRAFT_MODLE is not read by draft" in text


def test_broken_dockerfile_fails_hadolint():
    errors = "\n".join(validate.hadolint_errors(FIXTURES / "Dockerfile.broken"))
    for rule in ("DL3007", "DL3013", "DL3003", "DL3025"):
        assert rule in errors


def test_compose_schema_is_the_compose_specification():
    schema = validate.compose_schema()
    assert "services" in schema["properties"]
    assert "service_healthy" in str(schema)


# ---------------------------------------------------------------- settings vs the code


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "gpu-tensor-parallel"])
def test_manifests_set_only_what_the_services_read(rendered, overlay):
    found = validate.k8s_settings(rendered[overlay])
    assert sorted(s.role.name for s in found) == ["draft", "http", "orchestrator", "target"]
    for settings in found:
        prefix = settings.role.prefix()
        assert any(name.startswith(prefix + "_") for name in settings.env), settings.where
        assert validate.settings_errors(settings) == []


def test_compose_sets_only_what_the_services_read(compose):
    found = validate.compose_settings(compose)
    assert sorted(s.role.name for s in found) == ["draft", "http", "orchestrator", "target"]
    for settings in found:
        assert validate.settings_errors(settings) == []


def test_role_prefixes_are_the_services_own():
    from service_common.config import env_name

    for role in validate.ROLES.values():
        server = importlib.import_module(f"{role.module}.server")
        assert server.ENV_PREFIX == role.prefix()
        assert "grace_s" in role.fields()  # drain time: validate.grace_errors reads it
        if role.protocol == "grpc":  # the HTTP API keeps no state and exports no metrics
            assert env_name(role.prefix(), "redis_url") == f"{role.prefix()}_REDIS_URL"
            assert "redis_url" in role.fields() and "metrics_port" in role.fields()


def test_otel_allow_list_names_real_sdk_variables():
    from opentelemetry.sdk import environment_variables

    for name in validate.OTEL_VARIABLES:
        assert getattr(environment_variables, name, None) == name


def test_entrypoint_runs_each_role_as_its_module(tmp_path):
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/bin/sh\necho "$@"\n')
    fake_python.chmod(fake_python.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    entrypoint = str(REPO_ROOT / "deploy" / "entrypoint.sh")
    for role in validate.ROLES.values():
        run = subprocess.run(
            ["sh", entrypoint, role.name, "--k", "4"], capture_output=True, text=True, env=env
        )
        assert (run.returncode, run.stdout.strip()) == (0, f"-m {role.module} --k 4")
    ranks = subprocess.run(
        ["sh", entrypoint, "ranks", "--node-index", "1"], capture_output=True, text=True, env=env
    )
    assert ranks.stdout.strip() == "-m model_runtime.tensor_parallel --node-index 1"
    assert (
        subprocess.run(["sh", entrypoint, "compiler"], capture_output=True, env=env).returncode == 2
    )
    assert subprocess.run(["sh", entrypoint], capture_output=True, env=env).returncode == 2


def test_healthcheck_reports_the_health_service():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert healthcheck.ports({"DRAFT_ADDRESS": f"0.0.0.0:{port}"}) == [port]
        assert healthcheck.ports({}) == [50050, 50051, 50052]
        # Under TLS the role's port asks for a client certificate: the health-only port answers.
        assert healthcheck.ports(
            {"DRAFT_ADDRESS": "0.0.0.0:1", "DRAFT_HEALTH_ADDRESS": f"0.0.0.0:{port}"}
        ) == [port]
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert healthcheck.serving(port)
        servicer.enter_graceful_shutdown()  # what SIGTERM does: NOT_SERVING while draining
        assert not healthcheck.serving(port)
    finally:
        server.stop(None)
    assert not healthcheck.serving(port, timeout_s=0.5)


# ---------------------------------------------------------------- launcher == compose


# Settings that differ between one host's processes and containers by nature: where
# things listen and are found, threads, telemetry sinks, logging, drain time.
HOST_SPECIFIC = {
    "address",
    "advertise_address",
    "worker_id",
    "target_addresses",
    "draft_addresses",
    "redis_url",
    "threads",
    "trace_exporter",
    "trace_file",
    "otlp_endpoint",
    "metrics_port",
    "log_level",
    "grace_s",
    "orchestrator_address",
}


class RecordingCluster:
    def __init__(self):
        self.started: list[tuple[str, str, list[str]]] = []

    def start(self, name: str, module: str, args: list[str], cpus=None) -> None:
        self.started.append((name, module, list(args)))

    def wait_healthy(self, name: str, address: str, timeout_s: float, sees=()) -> None:
        return None


def launcher_runs() -> list[list[tuple[str, str, list[str]]]]:
    """What the launcher starts with its defaults (and with Redis, once it has the option)."""
    launcher = importlib.import_module("launcher.cluster")
    argvs = [[]]
    if "redis_url" in vars(launcher.parse_args([])):
        argvs.append(["--redis-url", "redis://127.0.0.1:6379/0"])
    runs = []
    for argv in argvs:
        cluster = RecordingCluster()
        launcher.start_system(launcher.parse_args(argv), cluster)
        runs.append(cluster.started)
    return runs


def typed(role, field_name: str, value):
    kind = typing.get_type_hints(role.config_class())[field_name]
    base = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
    return value if value is None or value == "" else base[0](value)


def launcher_compose_differences(compose: dict) -> list[str]:
    """How the processes the launcher starts differ from the compose file's services."""
    by_module = {s.role.module: s for s in validate.compose_settings(compose)}
    differences = []
    for started in launcher_runs():
        modules = {module for _, module, _ in started}
        if modules != set(by_module):
            differences.append(f"launcher starts {sorted(modules)}, compose {sorted(by_module)}")
        for name, module, args in started:
            settings = by_module.get(module)
            if settings is None:
                continue
            role, prefix, fields = settings.role, settings.role.prefix(), settings.role.fields()
            for field_name, value in validate._flags(args).items():
                if field_name not in fields:
                    differences.append(
                        f"launcher passes --{field_name} to {name}: not a field of {role.config}"
                    )
                    continue
                if field_name in HOST_SPECIFIC:
                    continue
                in_compose = settings.env.get(
                    f"{prefix}_{field_name.upper()}", settings.flags.get(field_name)
                )
                if in_compose is None:
                    in_compose = fields[field_name].default
                if typed(role, field_name, value) != typed(role, field_name, in_compose):
                    differences.append(
                        f"{name}: launcher --{field_name.replace('_', '-')} {value!r}, "
                        f"compose {in_compose!r}"
                    )
    return differences


def test_launcher_and_compose_start_the_same_roles_with_the_same_settings(compose):
    assert launcher_compose_differences(compose) == []


def test_launcher_comparison_can_fail(compose):
    changed = yaml.safe_load(yaml.safe_dump(compose))
    changed["services"]["target"]["environment"]["TARGET_MODEL"] = "tiny-random:7"
    del changed["services"]["draft"]
    differences = "\n".join(launcher_compose_differences(changed))
    assert "launcher --model 'smollm2-135m', compose 'tiny-random:7'" in differences
    assert "compose ['http_api', 'orchestrator', 'target_service']" in differences


# ---------------------------------------------------------------- what the manifests promise


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "gpu-tensor-parallel"])
def test_services_probes_and_resources(rendered, overlay):
    objects = rendered[overlay]
    services = objects_of(objects, "Service")
    for role in validate.GRPC_ROLES.values():
        service = services[f"specdec-{role.name}"]
        headless = service["spec"].get("clusterIP") == "None"
        assert headless == (role.name != "orchestrator"), service["metadata"]["name"]
        assert service["spec"]["ports"][0]["port"] == role.port
        pod, container = role_container(objects, role.name)
        assert {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"] == role.port
        # Under TLS (components/tls) kubelet's probes ask the plaintext health-only port.
        health = role_settings(objects, role.name).env.get(f"{role.prefix()}_HEALTH_ADDRESS")
        probe_port = int(health.rpartition(":")[2]) if health else role.port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == probe_port, (role.name, probe)
        assert (
            container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]
        )
        assert pod["securityContext"]["runAsNonRoot"] is True
        # Metrics on: the HPA's gauges come from this endpoint.
        settings = role_settings(objects, role.name)
        assert int(settings.env[f"{role.prefix()}_METRICS_PORT"]) == 9464


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "gpu-tensor-parallel"])
def test_workers_register_their_pod_in_redis(rendered, overlay):
    for role in ("target", "draft"):
        settings = role_settings(rendered[overlay], role)
        prefix = settings.role.prefix()
        assert (
            settings.env[f"{prefix}_ADVERTISE_ADDRESS"] == f"$(POD_IP):{validate.ROLES[role].port}"
        )
        assert settings.env[f"{prefix}_REDIS_URL"].startswith(
            "redis://:$(REDIS_PASSWORD)@specdec-redis:6379"
        )
    orchestrator = role_settings(rendered[overlay], "orchestrator")
    assert orchestrator.env["ORCHESTRATOR_REDIS_URL"].startswith("redis://:$(REDIS_PASSWORD)@")
    assert "ORCHESTRATOR_TARGET_ADDRESSES" not in orchestrator.env


def pods_metrics(hpa: dict) -> dict[str, dict]:
    """The HPA's Pods metrics: metric name -> its target."""
    return {
        m["pods"]["metric"]["name"]: m["pods"]["target"]
        for m in hpa["spec"]["metrics"]
        if m["type"] == "Pods"
    }


def quantity(value) -> float:
    """A Kubernetes quantity as the HPA reads it ("800m" = 0.8)."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


# The Pods metric each pool's HPA scales on (the sessions gauge in both; calls per
# running slot only in the target, the pool with admission control; the draft-to-verify
# time ratio only in the draft, the pool that drafts).
POOL_METRICS = {
    "target": {"specdec_worker_sessions_active", "specdec_worker_calls_utilization"},
    "draft": {"specdec_worker_sessions_active", "specdec_worker_draft_verify_time_ratio"},
}


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "gpu-tensor-parallel"])
def test_each_pool_scales_on_its_own_gauges(rendered, overlay):
    hpas = objects_of(rendered[overlay], "HorizontalPodAutoscaler")
    for role in ("target", "draft"):
        hpa = hpas[f"specdec-{role}"]
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": f"specdec-{role}",
        }
        assert set(pods_metrics(hpa)) == POOL_METRICS[role]
        for target in pods_metrics(hpa).values():
            assert target["type"] == "AverageValue" and quantity(target["averageValue"]) > 0
        resources = [m["resource"] for m in hpa["spec"]["metrics"] if m["type"] == "Resource"]
        assert [r["name"] for r in resources] == ["cpu"]  # the fallback
        if role == "draft":  # aims below 1, where drafting holds the rounds up
            ratio = pods_metrics(hpa)["specdec_worker_draft_verify_time_ratio"]
            assert quantity(ratio["averageValue"]) < 1
        # The Deployment leaves the count to the HPA.
        assert (
            "replicas" not in objects_of(rendered[overlay], "Deployment")[f"specdec-{role}"]["spec"]
        )


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "gpu-tensor-parallel"])
def test_target_pool_scales_out_before_its_calls_queue_or_are_refused(rendered, overlay):
    """The calls metric aims at most at 1 call per running slot (no queue), below the
    point where a pod refuses calls, 1 + max_queued / max_running, with the overlay's
    settings (the TargetConfig defaults where it sets none); and the sessions target
    stays below max_sessions (before the LRU evicts)."""
    from target_service.config import TargetConfig

    hpa = objects_of(rendered[overlay], "HorizontalPodAutoscaler")["specdec-target"]
    env = role_settings(rendered[overlay], "target").env
    defaults = TargetConfig()

    def setting(name: str) -> int:
        return int(env.get(f"TARGET_{name.upper()}") or getattr(defaults, name))

    targets = {name: quantity(target["averageValue"]) for name, target in pods_metrics(hpa).items()}
    refused_above = 1 + setting("max_queued") / setting("max_running")
    assert 0 < targets["specdec_worker_calls_utilization"] <= 1 < refused_above
    assert targets["specdec_worker_sessions_active"] < setting("max_sessions")
    # A step has room for every running session's proposal at the default k (4 + 1 tokens).
    assert setting("max_batch_tokens") >= setting("max_running") * 5
    assert setting("max_running") <= setting("max_sessions")


def test_hpa_metrics_are_gauges_the_workers_export(rendered):
    """Each HPA's Pods metrics are gauges its pool's workers export, each served by a
    prometheus-adapter rule reading that gauge's series per pod (and the check fails on
    a metric without one)."""
    telemetry = pytest.importorskip("service_common.telemetry")
    exported = {
        "target": {
            name.replace(".", "_")
            for name in (
                telemetry.SESSIONS_ACTIVE_GAUGE,
                telemetry.LOAD_GAUGE,
                telemetry.CACHED_TOKENS_GAUGE,
                telemetry.CALLS_UTILIZATION_GAUGE,
                telemetry.CALLS_RUNNING_GAUGE,
                telemetry.CALLS_QUEUED_GAUGE,
                telemetry.MAX_RUNNING_GAUGE,
                telemetry.BATCH_MEAN_TOKENS_GAUGE,
                telemetry.BATCH_MAX_TOKENS_GAUGE,
            )
        },
        # The draft has no admission: the memory gauges, and its rounds' time ratio.
        "draft": {
            name.replace(".", "_")
            for name in (
                telemetry.SESSIONS_ACTIVE_GAUGE,
                telemetry.LOAD_GAUGE,
                telemetry.CACHED_TOKENS_GAUGE,
                telemetry.DRAFT_VERIFY_TIME_RATIO_GAUGE,
            )
        },
    }
    assert telemetry.SESSIONS_ACTIVE_GAUGE.replace(".", "_") == "specdec_worker_sessions_active"
    assert telemetry.CALLS_UTILIZATION_GAUGE.replace(".", "_") == "specdec_worker_calls_utilization"
    assert (
        telemetry.DRAFT_VERIFY_TIME_RATIO_GAUGE.replace(".", "_")
        == "specdec_worker_draft_verify_time_ratio"
    )
    served = validate.adapter_metrics()
    assert set(served.values()) <= exported["target"] | exported["draft"]
    for overlay, objects in rendered.items():
        for role in ("target", "draft"):
            hpa = objects_of(objects, "HorizontalPodAutoscaler")[f"specdec-{role}"]
            assert set(pods_metrics(hpa)) <= exported[role], (overlay, role)
        assert validate.hpa_metric_errors(objects, served) == [], overlay
    unserved = {k: v for k, v in served.items() if k != "specdec_worker_draft_verify_time_ratio"}
    assert validate.hpa_metric_errors(rendered["cpu"], unserved) == [
        "HorizontalPodAutoscaler/specdec-draft: Pods metric specdec_worker_draft_verify_time_ratio "
        "is served by no rule of deploy/k8s/prometheus-adapter-values.yaml reading the series "
        "specdec_worker_draft_verify_time_ratio per pod"
    ]


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "gpu-tensor-parallel"])
def test_disruption_budgets_cover_every_role(rendered, overlay):
    budgets = objects_of(rendered[overlay], "PodDisruptionBudget")
    for role in validate.ROLES:
        selector = budgets[f"specdec-{role}"]["spec"]["selector"]["matchLabels"]
        assert selector["app.kubernetes.io/component"] == role


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "gpu-tensor-parallel"])
def test_redis_persists_with_aof_behind_a_secret(rendered, overlay):
    objects = rendered[overlay]
    redis = objects_of(objects, "StatefulSet")["specdec-redis"]
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert "$(REDIS_PASSWORD)" in args
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    secrets = objects_of(objects, "Secret")
    if overlay == "cpu":  # a generated development Secret that every reference finds
        for settings in validate.k8s_settings(objects):
            pod, container = role_container(objects, settings.role.name)
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["data"]
    else:  # production: created out of band, never committed
        assert secrets == {}


def test_gpu_overlay_places_pools_on_gpus(rendered):
    objects = rendered["gpu"]
    pod, target = role_container(objects, "target")
    assert int(target["resources"]["limits"]["nvidia.com/gpu"]) > 1
    assert pod["nodeSelector"] and pod["tolerations"]
    settings = role_settings(objects, "target")
    assert (
        settings.env["TARGET_DEVICE_MAP"] == "auto" and settings.env["TARGET_DTYPE"] == "bfloat16"
    )
    pod, draft = role_container(objects, "draft")
    assert int(draft["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert role_settings(objects, "draft").env["DRAFT_DEVICE"] == "cuda"
    assert objects_of(objects, "PersistentVolumeClaim")["specdec-models"]


def test_tensor_parallel_overlay_runs_one_rank_per_gpu_of_the_pod(rendered):
    objects = rendered["gpu-tensor-parallel"]
    pod, target = role_container(objects, "target")
    settings = role_settings(objects, "target").env
    ranks = int(settings["TARGET_TENSOR_PARALLEL"])
    assert ranks > 1
    assert int(target["resources"]["limits"]["nvidia.com/gpu"]) == ranks
    assert int(target["resources"]["requests"]["nvidia.com/gpu"]) == ranks
    # one way to shard
    assert not settings["TARGET_DEVICE_MAP"] and settings["TARGET_DEVICE"] == "cuda"
    # NCCL's /dev/shm
    assert any(volume.get("emptyDir", {}).get("medium") == "Memory" for volume in pod["volumes"])


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "gpu-tensor-parallel"])
def test_http_api_is_a_service_probed_on_health_that_scales_on_cpu(rendered, overlay):
    objects = rendered[overlay]
    role = validate.ROLES["http"]
    service = objects_of(objects, "Service")["specdec-http"]
    assert (
        service["spec"].get("clusterIP") != "None"
        and service["spec"]["ports"][0]["port"] == role.port
    )
    pod, container = role_container(objects, "http")
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["http"] == role.port
    paths = {
        probe: container[probe]["httpGet"]["path"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    # Ready once the orchestrator serves; alive while the server answers (an orchestrator
    # outage must not restart the front).
    assert paths == {
        "startupProbe": "/health",
        "readinessProbe": "/health",
        "livenessProbe": "/health/live",
    }
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    settings = role_settings(objects, "http")
    assert settings.env["HTTP_API_ORCHESTRATOR_ADDRESS"] == "specdec-orchestrator:50050"
    hpa = objects_of(objects, "HorizontalPodAutoscaler")["specdec-http"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "specdec-http"
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    assert "replicas" not in objects_of(objects, "Deployment")["specdec-http"]["spec"]
    if overlay.startswith("gpu"):  # components/tls: the orchestrators ask for a client certificate
        assert settings.env["HTTP_API_TLS_CERT"] and settings.env["HTTP_API_TLS_CA"]


def test_compose_wiring(compose):
    services = compose["services"]
    redis_command = services["redis"]["command"]
    assert redis_command[redis_command.index("--appendonly") + 1] == "yes"
    assert any(volume.endswith(":/data") for volume in services["redis"]["volumes"])
    for settings in validate.compose_settings(compose):
        if settings.role.protocol != "grpc":
            continue
        service = services[settings.where.removeprefix("compose: ")]
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        assert settings.env[f"{settings.role.prefix()}_REDIS_URL"] == "redis://redis:6379/0"
        endpoint = settings.env[f"{settings.role.prefix()}_OTLP_ENDPOINT"]
        assert endpoint == "http://jaeger:4317" and "jaeger" in services
    assert {
        dep: c["condition"]
        for dep, c in services["orchestrator"]["depends_on"].items()
        if dep != "jaeger"
    } == {"redis": "service_healthy", "target": "service_healthy", "draft": "service_healthy"}
    assert "127.0.0.1:50050:50050" in services["orchestrator"]["ports"]
    http = services["http"]
    assert http["depends_on"] == {"orchestrator": {"condition": "service_healthy"}}
    assert http["environment"]["HTTP_API_ORCHESTRATOR_ADDRESS"] == "orchestrator:50050"
    assert "127.0.0.1:8000:8000" in http["ports"]


# ---------------------------------------------------------------- the compose settings, run


def gauge_value(text: str, name: str) -> float:
    """The value of the one sample of a gauge on a worker's /metrics."""
    values = [
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    assert len(values) == 1, f"{name}: {values}"
    return values[0]


def test_compose_settings_run_a_system_that_generates(compose, redis_server, tmp_path):
    """What `docker compose up` + the client do, without containers: each role's
    environment as docker-compose.yml writes it, run through the image's entrypoint,
    started in the compose file's depends_on order once what it depends on passes the
    image's health check. Only what a container gives for free is replaced: host names
    (redis, jaeger), ports (one host), and the target model, set as a user would
    (TARGET_MODEL=... is interpolated into the compose file)."""
    from launcher.cluster import free_port

    user_env = {"TARGET_MODEL": "tiny-random:1"}
    services = compose["services"]
    processes: dict[str, subprocess.Popen] = {}
    ports: dict[str, int] = {}
    metrics_ports: dict[str, int] = {}

    def start(settings) -> None:
        role, prefix, service = (
            settings.role,
            settings.role.prefix(),
            settings.where.removeprefix("compose: "),
        )
        env = {
            name: validate.INTERPOLATION.sub(
                lambda m: user_env.get(m.group(1) or m.group(3), m.group(2) or ""), str(raw)
            )
            for name, raw in services[service]["environment"].items()
        }
        ports[service] = free_port()
        if role.protocol == "http":  # the orchestrator's host name is this host's
            assert env[f"{prefix}_ORCHESTRATOR_ADDRESS"] == "orchestrator:50050"
            env.update(
                {
                    f"{prefix}_ORCHESTRATOR_ADDRESS": f"127.0.0.1:{ports['orchestrator']}",
                    f"{prefix}_ADDRESS": f"127.0.0.1:{ports[service]}",
                }
            )
        assert role.protocol == "http" or env[f"{prefix}_REDIS_URL"] == "redis://redis:6379/0"
        env.update(
            {}
            if role.protocol == "http"
            else {
                f"{prefix}_REDIS_URL": redis_server.url,
                f"{prefix}_ADDRESS": f"127.0.0.1:{ports[service]}",
                f"{prefix}_TRACE_EXPORTER": "none",  # no Jaeger here
                f"{prefix}_METRICS_PORT": str(metrics_ports.setdefault(service, free_port())),
                f"{prefix}_THREADS": "1",
            }
        )
        if role.name not in ("orchestrator", "http"):
            env[f"{prefix}_ADVERTISE_ADDRESS"] = f"127.0.0.1:{ports[service]}"
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
        processes[service] = subprocess.Popen(
            ["sh", str(REPO_ROOT / "deploy" / "entrypoint.sh"), role.name],
            env={**os.environ, "PATH": path, "HF_HUB_OFFLINE": "1", **env},
            stdout=open(tmp_path / f"{service}.log", "w"),
            stderr=subprocess.STDOUT,
        )

    def wait_healthy(service: str) -> None:
        deadline = time.monotonic() + 120
        check = (
            healthcheck.http_serving
            if by_service[service].role.protocol == "http"
            else healthcheck.serving
        )
        while not check(ports[service], timeout_s=1.0):
            assert processes[service].poll() is None, (tmp_path / f"{service}.log").read_text()[
                -3000:
            ]
            assert time.monotonic() < deadline, f"{service} not SERVING after 120 s"
            time.sleep(0.5)

    by_service = {s.where.removeprefix("compose: "): s for s in validate.compose_settings(compose)}
    try:
        started: list[str] = []
        while len(started) < len(by_service):
            ready = [
                name
                for name in by_service
                if name not in started
                and all(
                    dep in started or dep not in by_service
                    for dep in services[name].get("depends_on", {})
                )
            ]
            assert ready, "depends_on has a cycle"
            for name in ready:
                start(by_service[name])
            for name in ready:
                wait_healthy(name)
            started += ready
        assert started[-2:] == ["orchestrator", "http"]
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "client",
                "The quick brown fox",
                "--address",
                f"127.0.0.1:{ports['orchestrator']}",
                "--max-new-tokens",
                "8",
                "--raw",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        logs = "\n".join(p.read_text()[-2000:] for p in sorted(tmp_path.glob("*.log")))
        assert run.returncode == 0, run.stderr + logs
        assert run.stdout.strip()
        # The README's curl, through the HTTP API.
        body = json.dumps(
            {"model": "tiny-random:1", "prompt": "The quick brown fox", "max_tokens": 8}
        ).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{ports['http']}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            completion = json.loads(reply.read())
        assert completion["usage"]["completion_tokens"] == 8 and completion["choices"][0]["text"], (
            logs
        )
        # The gauges the HPAs scale on, on each worker's /metrics; the target's calls
        # and batch gauges with its configured limits (compose leaves them at the defaults).
        from target_service.config import TargetConfig

        scraped = {}
        for worker in ("target", "draft"):
            with urllib.request.urlopen(
                f"http://127.0.0.1:{metrics_ports[worker]}/metrics", timeout=10
            ) as reply:
                scraped[worker] = reply.read().decode()
            assert (
                "specdec_worker_sessions_active" in scraped[worker]
                and "specdec_worker_load" in scraped[worker]
            )
        # The generation's rounds, on the draft only (the target drafts nothing).
        assert gauge_value(scraped["draft"], "specdec_worker_draft_verify_time_ratio") > 0
        assert "specdec_worker_draft_verify_time_ratio" not in scraped["target"]
        target_env = services["target"]["environment"]
        limits = {
            name: int(target_env.get(f"TARGET_{name.upper()}", getattr(TargetConfig(), name)))
            for name in ("max_running", "max_batch_tokens")
        }
        assert (
            gauge_value(scraped["target"], "specdec_worker_calls_max_running")
            == limits["max_running"]
        )
        assert (
            gauge_value(scraped["target"], "specdec_worker_batch_max_tokens")
            == limits["max_batch_tokens"]
        )
        # the generation's steps
        assert gauge_value(scraped["target"], "specdec_worker_batch_mean_tokens") > 0
        assert gauge_value(scraped["target"], "specdec_worker_calls_utilization") >= 0
        assert "specdec_worker_calls_utilization" not in scraped["draft"]  # no admission on drafts
    finally:
        for process in processes.values():
            process.terminate()
        for name, process in processes.items():
            # SIGTERM drains (NOT_SERVING, calls finish) and exits cleanly within grace_s.
            assert process.wait(timeout=30) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]


# ---------------------------------------------------------------- beyond one node


def test_the_multinode_target_is_one_leaderworkerset_group_of_tensor_parallel_ranks(rendered):
    """The leader serves as the target worker (rank 0 and its node's ranks), the worker
    pod runs the other node's ranks from the same settings; GPUs, ranks and group size
    agree, and the pool scales by groups."""
    objects = rendered["gpu-multinode"]
    assert "specdec-target" not in objects_of(objects, "Deployment")
    lws = objects_of(objects, "LeaderWorkerSet")["specdec-target"]
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = next(s for s in validate.k8s_settings(objects) if "leaderTemplate" in s.where)
    assert leader.role.name == "target"
    ranks = int(leader.env["TARGET_TENSOR_PARALLEL"])
    local = int(leader.env["TARGET_TENSOR_PARALLEL_LOCAL"])
    assert (
        group["size"] * local == ranks
        and leader.env["TARGET_TENSOR_PARALLEL_MASTER"] == "$(POD_IP)"
    )
    assert leader.env["TARGET_TENSOR_PARALLEL_PORT"] and not leader.env.get("TARGET_DEVICE_MAP")
    worker = group["workerTemplate"]["spec"]["containers"][0]
    assert worker["args"] == [
        "ranks",
        "--node-index",
        "$(LWS_WORKER_INDEX)",
        "--master-addr",
        "$(LWS_LEADER_ADDRESS)",
    ]
    leader_container = group["leaderTemplate"]["spec"]["containers"][0]
    # one set of TARGET_* settings for every rank
    assert worker["envFrom"] == leader_container["envFrom"]
    for container in (worker, leader_container):
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == local
    ports = {p["name"]: p["containerPort"] for p in leader_container["ports"]}
    assert ports["rendezvous"] == int(leader.env["TARGET_TENSOR_PARALLEL_PORT"])
    hpa = objects_of(objects, "HorizontalPodAutoscaler")["specdec-target"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": validate.LWS_API,
        "kind": "LeaderWorkerSet",
        "name": "specdec-target",
    }


def test_a_bad_leaderworkerset_fails_validation(rendered):
    import copy

    objects = copy.deepcopy(rendered["gpu-multinode"])
    lws = objects_of(objects, "LeaderWorkerSet")["specdec-target"]
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Sometimes"
    lws["spec"]["leaderWorkerTemplate"]["groupSize"] = 2
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["cpu"] = "8"
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    leader["env"].append({"name": "TARGET_TENSOR_PARALELL", "value": "8"})
    errors = "\n".join(
        validate.schema_errors(objects)
        + [e for s in validate.k8s_settings(objects) for e in validate.settings_errors(s)]
    )
    assert "'Sometimes' is not one of" in errors
    assert "groupSize: not a field" in errors
    # PodTemplate schema
    assert "workerTemplate: template.spec.containers.0: Additional properties" in errors
    assert "TARGET_TENSOR_PARALELL is not read by target" in errors
