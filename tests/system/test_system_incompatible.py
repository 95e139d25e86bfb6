"""A draft pool whose model has another vocabulary than the target's: the orchestrator
refuses to pair them, precisely, and still serves requests that need no vocabulary."""

from __future__ import annotations

import grpc
import pytest

from specdec.v1 import common_pb2, orchestrator_pb2
from tests.local_system import LocalSystem


@pytest.fixture(scope="module")
def system():
    # SmolLM2's tokenizer (49152 tokens) against the tiny byte-level target (257).
    with LocalSystem(target_model="tiny-random:1", draft_model="smollm2-135m") as local:
        yield local


def _request(drafter: str) -> orchestrator_pb2.GenerateRequest:
    request = orchestrator_pb2.GenerateRequest(text="hello hello hello")
    request.sampling.max_new_tokens = 8
    request.speculation.CopyFrom(
        common_pb2.SpeculationParams(num_speculative_tokens=4, drafter=drafter)
    )
    return request


def test_model_draft_with_another_tokenizer_is_refused(system):
    with pytest.raises(grpc.RpcError) as error:
        system.stub.Generate(_request("model"), timeout=60)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "draft 'smollm2-135m'" in error.value.details()
    assert "cannot serve target 'tiny-random:1'" in error.value.details()
    # The n-gram drafter on the same worker needs no vocabulary: served.
    response = system.stub.Generate(_request("ngram"), timeout=60)
    assert len(response.token_ids) == 8
