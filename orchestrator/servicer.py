"""The public gRPC API: thin translation between the wire and Generation / the store."""

from __future__ import annotations

import uuid

from orchestrator.config import OrchestratorConfig
from orchestrator.generation import Generation
from orchestrator.limits import check_max_new_tokens, check_prompt_tokens, check_session_quota
from orchestrator.store import SessionRecord, SessionStore
from orchestrator.text import render_chat
from orchestrator.tokenizer import TargetTokenizer
from orchestrator.workers import DRAFT, TARGET, WorkerPool, close_worker_sessions
from service_common.auth import current_caller
from service_common.status import Unavailable, rpc_errors
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(
        self,
        config: OrchestratorConfig,
        pool: WorkerPool,
        store: SessionStore,
        tokenizer: TargetTokenizer,
    ):
        self.config, self.pool, self.store, self.tokenizer = config, pool, store, tokenizer

    @rpc_errors
    def Generate(self, request, context):
        response = orchestrator_pb2.GenerateResponse()
        generation = self._generation(request, context)
        for chunk in generation.run():
            response.text += chunk.text_delta
            response.token_ids.extend(chunk.token_ids)
            response.token_sources.extend(chunk.sources)
            response.num_prompt_tokens = chunk.num_prompt_tokens or response.num_prompt_tokens
            response.finish_reason = chunk.finish_reason
            if chunk.stats is not None:
                response.stats.CopyFrom(chunk.stats)
        response.session_id = generation.session_id
        return response

    @rpc_errors
    def GenerateStream(self, request, context):
        first = True
        generation = self._generation(request, context)
        for chunk in generation.run():
            message = orchestrator_pb2.GenerateChunk(
                text_delta=chunk.text_delta,
                token_ids=chunk.token_ids,
                finish_reason=chunk.finish_reason,
                token_sources=chunk.sources,
                token_texts=chunk.texts,
                num_drafted=chunk.num_drafted,
                num_prompt_tokens=chunk.num_prompt_tokens,
            )
            if first:
                message.session_id, first = generation.session_id, False
            if chunk.stats is not None:
                message.stats.CopyFrom(chunk.stats)
            yield message

    def _generation(self, request, context) -> Generation:
        caller = current_caller()
        if request.session_id:
            # Before the session's lease is taken: another key's call must not make the
            # owner's busy, nor learn from "busy" that the session exists.
            self.store.get_owned(request.session_id, caller)
        else:
            check_session_quota(self.config, self.store, caller)
        return Generation(
            self.config, self.pool, self.store, self.tokenizer.get(), request, context, caller
        )

    @rpc_errors
    def CreateSession(self, request, context):
        caller = current_caller()
        check_session_quota(self.config, self.store, caller)
        record = SessionRecord(uuid.uuid4().hex, [], owner=caller)
        if request.system_prompt:
            # Rendered now, prefilled on the first Generate (which places the session).
            record.messages = [{"role": "system", "content": request.system_prompt}]
            record.token_ids = render_chat(
                self.tokenizer.get(), record.messages, add_generation_prompt=False
            )
            check_prompt_tokens(self.config, len(record.token_ids))
        if request.HasField("sampling"):
            check_max_new_tokens(self.config, request.sampling.max_new_tokens)
            record.sampling = request.sampling.SerializeToString()
        if request.HasField("speculation"):
            record.speculation = request.speculation.SerializeToString()
        self.store.put(record)
        return self._describe(record)

    @rpc_errors
    def GetSession(self, request, context):
        return self._describe(self.store.get_owned(request.session_id, current_caller()))

    @rpc_errors
    def CloseSession(self, request, context):
        self.store.get_owned(
            request.session_id, current_caller()
        )  # before the lease: as in _generation
        with self.store.lease(request.session_id) as lease:
            record = self.store.get_owned(request.session_id, current_caller())
            close_worker_sessions(
                self.pool,
                ((TARGET, record.target), (DRAFT, record.draft)),
                self.config.rpc_timeout_s,
            )
            self.store.delete(record.session_id, lease)
        return common_pb2.CloseSessionResponse()

    @rpc_errors
    def ListWorkers(self, request, context):
        workers = self.pool.describe()
        if not workers and self.pool.discovery_error:  # "none" would be a guess: say why
            raise Unavailable(self.pool.why_empty("the worker registry cannot be read"))
        return orchestrator_pb2.ListWorkersResponse(workers=workers)

    def _describe(self, record: SessionRecord) -> orchestrator_pb2.Session:
        session = orchestrator_pb2.Session(
            session_id=record.session_id,
            num_committed_tokens=len(record.token_ids),
            created_unix_ms=record.created_ms,
            last_used_unix_ms=record.last_used_ms,
        )
        for field, handle in (("target", record.target), ("draft", record.draft)):
            if handle is not None:
                getattr(session, field).CopyFrom(
                    common_pb2.KvHandle(
                        worker_id=handle.worker_id,
                        worker_address=handle.address,
                        session_id=handle.session_id,
                        committed_len=handle.committed_len,
                    )
                )
        if record.sampling:
            session.sampling.ParseFromString(record.sampling)
        if record.speculation:
            session.speculation.ParseFromString(record.speculation)
        return session
