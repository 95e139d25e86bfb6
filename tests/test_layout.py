"""The layout's rules, checked on the source: who may import whom, and links that resolve.

Import rules (docs/architecture.md): the core (`speculative/`) knows nothing of gRPC or
the protocol; the workers share only the common and their own contracts, never the
orchestrator's; tests and benchmarks start systems through `launcher.cluster`, never
through the command module `launcher.__main__`.
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
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def violations(folders: tuple[str, ...], forbidden: re.Pattern) -> list[str]:
    return [f"{path.relative_to(ROOT)} imports {name}"
            for path in sources(*folders) for name in sorted(imported_modules(path)) if forbidden.fullmatch(name)]


RULES = [
    (("target_service", "draft_service", "service_common"), r"specdec\.v1\.orchestrator_pb2(_grpc)?"),
    (("speculative",), r"(grpc|specdec|service_common|orchestrator|target_service|draft_service)(\..*)?"),
    (("tests", "benchmarks"), r"launcher\.__main__(\..*)?"),
]


@pytest.mark.parametrize("folders, forbidden", RULES, ids=[",".join(f) for f, _ in RULES])
def test_import_rule(folders: tuple[str, ...], forbidden: str) -> None:
    assert violations(folders, re.compile(forbidden)) == []


def test_import_rule_check_catches_a_violation(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from specdec.v1 import orchestrator_pb2\n")
    assert "specdec.v1.orchestrator_pb2" in imported_modules(module)


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
    page.write_text("[design](../../shared/DESIGN.md) [missing](nothing_here.md) [ok](architecture.md)\n")
    try:
        assert broken_links(page) == ["docs/_link_check_probe.md: ../../shared/DESIGN.md",
                                      "docs/_link_check_probe.md: nothing_here.md"]
    finally:
        page.unlink()
