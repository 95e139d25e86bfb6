"""A scripted target worker's bookkeeping, for tests of the services in front of it."""

from __future__ import annotations

import uuid

from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc

VOCAB_SIZE = 257  # the tiny tokenizer's (the orchestrator decodes with it)


class BookkeepingTarget(target_pb2_grpc.TargetServiceServicer):
    """Answers Info, OpenSession, Extend, Truncate and CloseSession at once, holding no
    state; a test's subclass scripts Verify or Decode."""

    name = "scripted"
    context_length = 1024

    def Info(self, request, context):
        return common_pb2.InfoResponse(
            worker_id=f"{self.name}-target",
            model=common_pb2.ModelInfo(
                model_id=self.name,
                tokenizer_fingerprint=self.name,
                vocab_size=VOCAB_SIZE,
                context_length=self.context_length,
            ),
        )

    def OpenSession(self, request, context):
        return target_pb2.OpenSessionResponse(
            handle=common_pb2.KvHandle(
                worker_id=f"{self.name}-target",
                session_id=uuid.uuid4().hex,
                committed_len=len(request.prompt_token_ids),
            )
        )

    def Extend(self, request, context):
        return common_pb2.ExtendResponse(committed_len=request.base_len + len(request.token_ids))

    def Truncate(self, request, context):
        return common_pb2.TruncateResponse(committed_len=request.length)

    def CloseSession(self, request, context):
        return common_pb2.CloseSessionResponse()
