"""Tracing across the three services as separate processes: one generation is one trace
whose span tree crosses orchestrator -> draft -> target, with one round span per round
whose counts add up to the generated tokens; `python -m report` reads those files.

Each role writes its own JSON-lines file (TARGET_/DRAFT_/ORCHESTRATOR_TRACE_EXPORTER and
_TRACE_FILE in the environment the processes inherit); spans are flushed when the
processes stop, so the checks run after the system is stopped.
"""

from __future__ import annotations

import json

import pytest

from report.__main__ import main as report_main
from specdec.v1 import common_pb2, orchestrator_pb2
from tests.local_system import LocalSystem
from tests.span_checks import check_round_times

ROLES = ("target", "draft", "orchestrator")
MAX_NEW_TOKENS = 24


def _request(ids, k: int) -> orchestrator_pb2.GenerateRequest:
    request = orchestrator_pb2.GenerateRequest(include_stats=True)
    request.token_ids.ids.extend(ids)
    request.sampling.CopyFrom(common_pb2.SamplingParams(max_new_tokens=MAX_NEW_TOKENS))
    request.speculation.CopyFrom(
        common_pb2.SpeculationParams(num_speculative_tokens=k, drafter="ngram")
    )
    return request


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory, prompt_ids):
    """One speculative and one target-only generation; returns (responses, span files)."""
    directory = tmp_path_factory.mktemp("traces")
    files = {role: directory / f"{role}.jsonl" for role in ROLES}
    with pytest.MonkeyPatch.context() as env:
        for role in ROLES:
            env.setenv(f"{role.upper()}_TRACE_EXPORTER", "jsonl")
            env.setenv(f"{role.upper()}_TRACE_FILE", str(files[role]))
        with LocalSystem() as system:
            speculative = system.stub.Generate(_request(prompt_ids[3], k=4), timeout=60)
            target_only = system.stub.Generate(_request(prompt_ids[3], k=0), timeout=60)
            logs = system.logs()
    missing = [role for role, path in files.items() if not path.exists()]
    assert not missing, f"no span file from {missing}:\n{logs}"
    return speculative, target_only, files


def _load(files) -> list[dict]:
    return [json.loads(line) for path in files.values() for line in path.read_text().splitlines()]


def test_one_generation_is_one_trace_across_the_three_processes(traced_run):
    response, _, files = traced_run
    spans = _load(files)
    by_id = {s["span_id"]: s for s in spans}
    service = lambda span: span["resource"]["service.name"]  # noqa: E731

    rounds = [s for s in spans if s["name"] == "specdec.round"]
    trace_ids = {s["trace_id"] for s in rounds}
    assert len(trace_ids) == 1, "the rounds of one generation are one trace"
    (trace_id,) = trace_ids
    in_trace = [s for s in spans if s["trace_id"] == trace_id]
    # A tree: one root, every other span's parent is in the same trace.
    roots = [s for s in in_trace if s["parent_span_id"] is None]
    assert len(roots) == 1 and service(roots[0]) == "orchestrator"
    assert roots[0]["name"] == "/specdec.v1.Orchestrator/Generate" and roots[0]["kind"] == "SERVER"
    assert all(s["parent_span_id"] in by_id for s in in_trace if s is not roots[0])
    assert {service(s) for s in in_trace} == set(ROLES)

    def ancestors(span):
        while span["parent_span_id"] is not None:
            span = by_id[span["parent_span_id"]]
            yield span

    # orchestrator -> draft: the Speculate server span's parent is the orchestrator's client span.
    (speculate,) = [
        s
        for s in in_trace
        if s["name"] == "/specdec.v1.DraftService/Speculate" and s["kind"] == "SERVER"
    ]
    assert service(speculate) == "draft"
    speculate_client = by_id[speculate["parent_span_id"]]
    assert service(speculate_client) == "orchestrator" and speculate_client["kind"] == "CLIENT"
    assert roots[0] in list(ancestors(speculate))
    # draft -> target: the Verify server span's parent is the draft's Verify client span,
    # a child of the Speculate server span.
    (verify,) = [
        s
        for s in in_trace
        if s["name"] == "/specdec.v1.TargetService/Verify" and s["kind"] == "SERVER"
    ]
    assert service(verify) == "target"
    verify_client = by_id[verify["parent_span_id"]]
    assert (
        service(verify_client) == "draft"
        and verify_client["parent_span_id"] == speculate["span_id"]
    )
    # Prefill on both workers, under their OpenSession server spans, in this trace.
    prefills = [s for s in in_trace if s["name"] == "specdec.prefill"]
    assert {service(s) for s in prefills} == {"target", "draft"}
    assert all(
        by_id[s["parent_span_id"]]["name"].endswith(("/OpenSession", "/Extend")) for s in prefills
    )

    # One round span per round, children of Speculate; the target verified each round.
    assert all(
        s["parent_span_id"] == speculate["span_id"] and service(s) == "draft" for s in rounds
    )
    rounds.sort(key=lambda s: s["attributes"]["specdec.round"])
    stats = response.stats
    assert len(rounds) == stats.num_rounds
    verifies = [s for s in in_trace if s["name"] == "specdec.verify"]
    assert all(s["parent_span_id"] == verify["span_id"] for s in verifies)
    # Proposals drafted ahead whose assumed context turned out wrong were discarded.
    assert len([s for s in verifies if not s["attributes"]["specdec.discarded"]]) == len(rounds)
    # A round outputs its accepted tokens plus the target's own, except a last round cut
    # at a stop token; together exactly the generated tokens.
    attributes = [s["attributes"] for s in rounds]
    for a in attributes[:-1]:
        assert a["specdec.committed"] == a["specdec.accepted"] + 1
    last = attributes[-1]
    assert 1 <= last["specdec.committed"] <= last["specdec.accepted"] + 1
    assert (
        sum(a["specdec.committed"] for a in attributes)
        == len(response.token_ids)
        == stats.num_generated_tokens
    )
    assert sum(a["specdec.accepted"] for a in attributes) == stats.num_accepted
    assert sum(a["specdec.k"] for a in attributes) == stats.num_drafted
    for a in attributes:
        check_round_times(a)
        assert a["specdec.proposal_bytes"] > 0 and a["specdec.verdict_bytes"] > 0


def test_target_only_generation_is_traced_as_decode_steps(traced_run):
    _, target_only, files = traced_run
    spans = _load(files)
    decode = [s for s in spans if s["name"] == "specdec.decode"]
    assert len(decode) == len(target_only.token_ids)
    assert len({s["trace_id"] for s in decode}) == 1


def test_report_on_the_trace(traced_run, tmp_path, capsys):
    _, _, files = traced_run
    assert report_main([*map(str, files.values()), "--plots", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for expected in (
        "acceptance rate:",
        "mean accepted length:",
        "acceptance by position:",
        "time per round (mean):",
        "target-only decoding:",
        "(measured: ",
        "measured speedup",
        "break-even round-trip delay R",
        "best k at the measured R",
    ):
        assert expected in out, out
    assert (tmp_path / "speedup_vs_k.png").stat().st_size > 10_000
    assert (tmp_path / "speedup_vs_delay.png").stat().st_size > 10_000
