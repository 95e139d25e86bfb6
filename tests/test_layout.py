"""The layout's rules, checked on the source: who may import whom, and links that resolve.

Import rules (docs/architecture.md): the core (`speculative/`, the algorithm, above
`model_runtime/`, the models it runs on, above `foundation/`, the base layer under both)
knows nothing of gRPC or the protocol, and no layer imports one above it; the workers
share only the common and their own contracts, never the orchestrator's; tests and
benchmarks start systems through `launcher.cluster`, never through the command module
`launcher.__main__`; production never imports `benchmarks/`; the capacity planner
(`planner/`) reads the algorithm, the base layer and the report and nothing of the
services, and production never imports it; the orchestrator, the draft worker without a
model and the planner import neither torch nor transformers when they start.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    """Every module path.py imports, by its dotted name (`from a import b` gives a and a.b)."""
    return {
        name
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for name in names_imported_by(node)
    }


def names_imported_by(node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if not node.module or node.level:
        return set()
    return {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}


def sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def violations(folders: tuple[str, ...], forbidden: re.Pattern) -> list[str]:
    return [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sources(*folders)
        for name in sorted(imported_modules(path))
        if forbidden.fullmatch(name)
    ]


PRODUCTION = (
    "foundation", "model_runtime", "speculative", "service_common", "target_service",
    "draft_service", "orchestrator", "launcher", "client", "report", "http_api",
)  # fmt: skip
RULES = [
    (
        ("target_service", "draft_service", "service_common"),
        r"specdec\.v1\.orchestrator_pb2(_grpc)?",
    ),
    (
        ("speculative",),
        r"(grpc|specdec|service_common|orchestrator|target_service|draft_service)(\..*)?",
    ),
    (
        ("model_runtime",),
        r"(grpc|specdec|service_common|orchestrator|target_service|draft_service)(\..*)?",
    ),
    # The layers one way: the base layer under both, the model runtime under the algorithm.
    (("model_runtime",), r"speculative(\..*)?"),
    (
        ("foundation",),
        r"(speculative|model_runtime|torch|transformers|grpc|specdec|service_common|orchestrator"
        r"|target_service|draft_service)(\..*)?",
    ),
    (("tests", "benchmarks"), r"launcher\.__main__(\..*)?"),
    # Production never imports the benchmarks (their delay proxy and plug-ins included).
    (PRODUCTION, r"benchmarks(\..*)?"),
    # The capacity planner: over the algorithm, the base layer and the report (it runs the
    # policy's code in simulated time), beside production, never under it.
    (
        ("planner",),
        r"(model_runtime|service_common|target_service|draft_service|orchestrator|launcher"
        r"|client|http_api|benchmarks|grpc|specdec|torch|transformers)(\..*)?",
    ),
    (PRODUCTION, r"planner(\..*)?"),
]


@pytest.mark.parametrize("folders, forbidden", RULES, ids=[",".join(f) for f, _ in RULES])
def test_import_rule(folders: tuple[str, ...], forbidden: str) -> None:
    assert violations(folders, re.compile(forbidden)) == []


def test_import_rule_check_catches_a_violation(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from specdec.v1 import orchestrator_pb2\n")
    assert "specdec.v1.orchestrator_pb2" in imported_modules(module)


# The policy is the one owner of what it measures: no module but speculative/policy.py
# reaches into a policy's estimator, and only the policy and the estimator's unit tests
# make one (everyone else starts, observes and ends calls through the policy's methods).
ESTIMATOR_OWNER = "speculative/policy.py"
ESTIMATOR_MAKERS = {
    ESTIMATOR_OWNER,
    "tests/speculative/test_estimator.py",
    "tests/speculative/test_token_tree.py",
}
CODE_FOLDERS = (*PRODUCTION, "planner", "benchmarks", "tests", "scripts")


def estimator_reaches(path: Path) -> list[str]:
    """Where path.py reads or sets a policy's estimator, or imports the estimator class."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("estimator", "_estimator"):
            if name != ESTIMATOR_OWNER:
                found.append(f"{name}:{node.lineno} reaches into .{node.attr}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if "speculative.estimator.CostEstimator" in names_imported_by(node):
                if name not in ESTIMATOR_MAKERS:
                    found.append(f"{name}:{node.lineno} imports CostEstimator")
    return found


def test_only_the_policy_reaches_into_its_estimator() -> None:
    assert [found for path in sources(*CODE_FOLDERS) for found in estimator_reaches(path)] == []


def test_estimator_check_catches_a_reach(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from speculative.estimator import CostEstimator\npolicy.estimator.passes.step_costs = ()\n"
    )
    assert len(estimator_reaches(module)) == 2


# Roles that start without torch or transformers (seconds of a cold start on 2 cores):
# followed through the repository's modules, what they import when imported reaches
# neither. The draft worker imports its model's modules inside a function, when it has one.
# The capacity planner runs the policy without a model, as the n-gram draft worker does.
TORCH_FREE_ROLES = ["draft_service.server", "orchestrator.server", "planner.__main__"]
MODEL_RUNTIME = re.compile(r"(torch|transformers)(\..*)?")


def startup_imports(path: Path) -> set[str]:
    """What importing path.py imports: not inside functions, nor under TYPE_CHECKING."""
    names: set[str] = set()
    statements = list(ast.parse(path.read_text(), filename=str(path)).body)
    while statements:
        node = statements.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(names_imported_by(node))
        elif isinstance(node, ast.If):
            type_checking = isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
            statements += node.orelse if type_checking else node.body + node.orelse
        elif isinstance(node, (ast.Try, ast.With, ast.ClassDef)):
            statements += [
                s
                for field in ("body", "handlers", "orelse", "finalbody")
                for s in getattr(node, field, [])
            ]
        elif isinstance(node, ast.ExceptHandler):
            statements += node.body
    return names


def source_of(module: str) -> Path | None:
    """The repository's file of a module (None: a library's, or a name that is no module)."""
    base = ROOT.joinpath(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def import_chain(module: str, forbidden: re.Pattern) -> list[str]:
    """The modules from `module` to the first forbidden one it imports when imported,
    through the repository's modules; [] when it imports none."""
    came_from: dict[str, str | None] = {module: None}
    queue = [module]
    while queue:
        current = queue.pop(0)
        if forbidden.fullmatch(current):
            return _path_back(came_from, current)
        path = source_of(current)
        for name in sorted(startup_imports(path)) if path else ():
            parts = name.split(".")
            # a.b imports a first
            for prefix in (".".join(parts[: i + 1]) for i in range(len(parts))):
                if prefix not in came_from:
                    came_from[prefix] = current
                    queue.append(prefix)
    return []


def _path_back(came_from: dict[str, str | None], module: str) -> list[str]:
    chain = [module]
    while came_from[chain[-1]] is not None:
        chain.append(came_from[chain[-1]])
    return chain[::-1]


@pytest.mark.parametrize("role", TORCH_FREE_ROLES)
def test_role_starts_without_the_model_runtime(role: str) -> None:
    assert import_chain(role, MODEL_RUNTIME) == []


def test_import_chain_finds_the_model_runtime_through_modules() -> None:
    chain = import_chain(
        "draft_service.draft_model", MODEL_RUNTIME
    )  # where a draft model is set up
    assert chain[0] == "draft_service.draft_model" and MODEL_RUNTIME.fullmatch(chain[-1]), chain
    assert len(chain) > 2  # it imports torch through the core's modules, not only itself


def test_startup_imports_leave_out_functions_and_type_checking(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nimport a\nif TYPE_CHECKING:\n    import b\n"
        "def f():\n    import c\nclass C:\n    import d\ntry:\n    import e\nexcept ImportError:\n    import g\n"
    )
    assert startup_imports(module) == {"typing", "typing.TYPE_CHECKING", "a", "d", "e", "g"}


# Markdown links: every relative link in the repository's Markdown resolves inside it.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def markdown_files() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode == 0 and tracked.stdout.strip():
        return [ROOT / line for line in tracked.stdout.split()]
    return sorted(p for p in ROOT.rglob("*.md") if ".venv" not in p.parts)


def broken_links(path: Path) -> list[str]:
    broken = []
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold no links
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        resolved = (path.parent / target.split("#", 1)[0]).resolve()
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            broken.append(f"{path.relative_to(ROOT)}: {target}")
    return broken


def test_markdown_links_resolve_inside_the_repository() -> None:
    files = markdown_files()
    assert files, "no Markdown files found"
    assert [b for path in files for b in broken_links(path)] == []


def test_link_check_catches_a_link_outside(tmp_path: Path) -> None:
    page = ROOT / "docs" / "_link_check_probe.md"
    page.write_text(
        "[design](../../shared/DESIGN.md) [missing](nothing_here.md) [ok](architecture.md)\n"
    )
    try:
        assert broken_links(page) == [
            "docs/_link_check_probe.md: ../../shared/DESIGN.md",
            "docs/_link_check_probe.md: nothing_here.md",
        ]
    finally:
        page.unlink()


# Folders of tests/ beside the source packages' (the tests by place: docs/testing.md).
TEST_FOLDERS_BEYOND_PACKAGES = {"system", "benchmarks", "deploy", "protos", "fixtures"}


def test_tests_mirror_the_source() -> None:
    """Every test file sits in the folder of the package it tests, never at the top."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    misplaced = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if path.parent.name not in packages | TEST_FOLDERS_BEYOND_PACKAGES
        and path != Path(__file__).resolve()
    ]
    assert not misplaced, f"tests outside a package's folder (docs/testing.md): {misplaced}"
