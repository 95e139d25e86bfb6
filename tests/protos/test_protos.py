"""The gRPC contracts: committed stubs match the .proto files, load, and are documented."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pool

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
GENERATOR = REPO_ROOT / "scripts" / "gen_protos.py"
PROTO_FILES = sorted(PROTO_ROOT.rglob("*.proto"))
EXPECTED_SERVICES = {
    "specdec.v1.TargetService",
    "specdec.v1.DraftService",
    "specdec.v1.Orchestrator",
}


def _files_under(root: Path) -> dict[str, bytes]:
    """Files under root/specdec by relative path, skipping bytecode caches."""
    return {
        path.relative_to(root).as_posix(): path.read_bytes()
        for path in sorted((root / "specdec").rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def _module_name(proto: Path) -> str:
    """protos/specdec/v1/target.proto -> specdec.v1.target"""
    return ".".join(proto.relative_to(PROTO_ROOT).with_suffix("").parts)


def _services(proto_text: str) -> list[str]:
    package = re.search(r"^package\s+([\w.]+)\s*;", proto_text, re.MULTILINE).group(1)
    return [
        f"{package}.{name}" for name in re.findall(r"^service\s+(\w+)", proto_text, re.MULTILINE)
    ]


# 1. The committed stubs are exactly what the generator makes from the .proto files.


def test_committed_stubs_match_protos(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(GENERATOR), "--out", str(tmp_path)], check=True, cwd=REPO_ROOT
    )
    fresh = _files_under(tmp_path)
    committed = _files_under(REPO_ROOT)
    assert fresh, "the generator wrote nothing"
    hint = "the generated stubs are out of date with protos/: run `make protos` and commit specdec/"
    assert sorted(fresh.keys() - committed.keys()) == [], f"missing generated files; {hint}"
    assert sorted(committed.keys() - fresh.keys()) == [], f"files not made by the generator; {hint}"
    changed = sorted(path for path in fresh if fresh[path] != committed[path])
    assert changed == [], f"generated files differ; {hint}"


def test_generator_is_deterministic(tmp_path: Path) -> None:
    for out in ("a", "b"):
        subprocess.run([sys.executable, str(GENERATOR), "--out", str(tmp_path / out)], check=True)
    assert _files_under(tmp_path / "a") == _files_under(tmp_path / "b")


# 2. Every module imports and registers its services.


@pytest.mark.parametrize("proto", PROTO_FILES, ids=lambda p: p.name)
def test_stubs_import_and_register_services(proto: Path) -> None:
    module_name = _module_name(proto)
    importlib.import_module(f"{module_name}_pb2")
    grpc_module = importlib.import_module(f"{module_name}_pb2_grpc")
    pool = descriptor_pool.Default()
    for full_name in _services(proto.read_text()):
        assert pool.FindServiceByName(full_name).full_name == full_name
        short_name = full_name.rsplit(".", 1)[1]
        assert hasattr(grpc_module, f"{short_name}Stub")
        assert hasattr(grpc_module, f"add_{short_name}Servicer_to_server")


def test_all_services_are_defined() -> None:
    found = {name for proto in PROTO_FILES for name in _services(proto.read_text())}
    assert found == EXPECTED_SERVICES


# 3. Every declaration carries a comment (a unit or shape for every field).

_FIELD = re.compile(
    r"^(optional\s+|repeated\s+)?(map<[^>]+>|[\w.]+)\s+(\w+)\s*=\s*\d+\s*(\[.*\])?\s*;$"
)
_ENUM_VALUE = re.compile(r"^(\w+)\s*=\s*-?\d+\s*(\[.*\])?\s*;$")
_BLOCK = re.compile(r"^(message|enum|oneof|service)\s+(\w+)\s*\{")
_RPC = re.compile(r"^rpc\s+(\w+)\s*\(")
_TOP_LEVEL = re.compile(r"^(syntax|package|import|option)\b.*;$")
_SKIPPED = re.compile(r"^(reserved|option)\b.*;$")


def undocumented(proto_text: str) -> list[str]:
    """Declarations without a `//` comment on the line before or at the end of the line.

    Checks messages, enums, oneofs, services, rpcs, fields and enum values. A line it
    cannot parse is reported too, so the check never silently skips a declaration (it
    expects one declaration per line, as in this repository's protos).
    """
    problems: list[str] = []
    blocks: list[str] = []  # kinds of the enclosing blocks, innermost last
    previous_is_comment = False
    for number, raw in enumerate(proto_text.splitlines(), start=1):
        code, _, trailing_comment = raw.partition("//")
        code = code.strip()
        commented = previous_is_comment or bool(trailing_comment.strip())
        previous_is_comment = raw.strip().startswith("//")
        if not code or code == "}":
            if code == "}":
                blocks.pop()
            continue
        inside = blocks[-1] if blocks else "file"
        if block := _BLOCK.match(code):
            name = f"{block.group(1)} {block.group(2)}"
            if code.count("{") > code.count("}"):
                blocks.append(block.group(1))
        elif rpc := _RPC.match(code):
            name = f"rpc {rpc.group(1)}"
            if code.count("{") > code.count("}"):
                blocks.append("rpc")
        elif inside in ("message", "oneof") and (field := _FIELD.match(code)):
            name = f"field {field.group(3)}"
        elif inside == "enum" and (value := _ENUM_VALUE.match(code)):
            name = f"enum value {value.group(1)}"
        elif (inside == "file" and _TOP_LEVEL.match(code)) or _SKIPPED.match(code):
            continue
        else:
            problems.append(f"line {number}: cannot parse {code!r}")
            continue
        if not commented:
            problems.append(f"line {number}: {name} has no comment")
    return problems


@pytest.mark.parametrize("proto", PROTO_FILES, ids=lambda p: p.name)
def test_every_declaration_is_commented(proto: Path) -> None:
    assert undocumented(proto.read_text()) == []


def test_comment_check_catches_missing_comments() -> None:
    text = """syntax = "proto3";
package x.v1;
// A message.
message M {
  // Commented, in tokens.
  int32 a = 1;
  repeated int32 b = 2;
  int64 c = 3;  // [n] trailing comment
  oneof o {
    string d = 4;
  }
}
enum E {
  E_UNSPECIFIED = 0;
}
// A service.
service S {
  rpc R(M) returns (M);
}
"""
    assert undocumented(text) == [
        "line 7: field b has no comment",
        "line 9: oneof o has no comment",
        "line 10: field d has no comment",
        "line 13: enum E has no comment",
        "line 14: enum value E_UNSPECIFIED has no comment",
        "line 18: rpc R has no comment",
    ]
