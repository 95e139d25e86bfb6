"""`python -m client "prompt"`: generate through the orchestrator, streaming the text.

python -m client "Summarize: ..." --address 127.0.0.1:50050 --k 4 --drafter ngram
python -m client "Hello" --tls-ca ca.pem --api-key "$SPECDEC_API_KEY"     # TLS, an API key
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from foundation.errors import InvalidArgument
from service_common.security import client_credentials
from service_common.server import channel
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc


def build_request(args) -> orchestrator_pb2.GenerateRequest:
    request = orchestrator_pb2.GenerateRequest(
        session_id=args.session, stop=args.stop, include_stats=True
    )
    if args.raw:
        request.text = args.prompt
    else:
        request.chat.messages.add(role="user", content=args.prompt)
    request.sampling.CopyFrom(
        common_pb2.SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
        )
    )
    if args.seed is not None:
        request.sampling.seed = args.seed
    request.speculation.CopyFrom(
        common_pb2.SpeculationParams(
            num_speculative_tokens=args.k, drafter=args.drafter, adaptive=args.adaptive
        )
    )
    return request


def print_stats(stats: common_pb2.GenerationStats) -> None:
    ms = 1e-6
    seconds = stats.total_ns * 1e-9
    rate = stats.num_generated_tokens / seconds if seconds else 0.0
    positions = " ".join(
        f"{a / d:.2f}" for a, d in zip(stats.accepted_per_position, stats.drafted_per_position) if d
    )
    print(
        f"tokens: {stats.num_generated_tokens} in {seconds:.2f} s ({rate:.1f} tokens/s), "
        f"{stats.num_rounds} rounds\n"
        f"drafted {stats.num_drafted}, accepted {stats.num_accepted} "
        f"(acceptance {stats.acceptance_rate:.1%}, {stats.mean_accepted_per_round:.2f} per drafting round); "
        f"by position: {positions or '-'}\n"
        f"time: prefill {stats.prefill_ns * ms:.0f} ms, draft {stats.draft_ns * ms:.0f} ms, verify "
        f"{stats.verify_ns * ms:.0f} ms (target compute {stats.target_compute_ns * ms:.0f} ms, network "
        f"{stats.network_ns * ms:.0f} ms), orchestrator {stats.orchestrator_ns * ms:.0f} ms",
        file=sys.stderr,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument(
        "--address", default=os.environ.get("ORCHESTRATOR_ADDRESS", "127.0.0.1:50050")
    )
    parser.add_argument("--session", default="", help="continue this session")
    parser.add_argument("--raw", action="store_true", help="send text, not a chat message")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument(
        "--drafter", default="", help="model, ngram, or empty for the worker's default"
    )
    parser.add_argument("--adaptive", action="store_true")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="deadline of the call, seconds"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SPECDEC_API_KEY", ""),
        help="API key, sent as 'authorization: Bearer KEY' (env SPECDEC_API_KEY)",
    )
    parser.add_argument(
        "--tls-ca",
        default="",
        help="PEM file of the CA that signed the orchestrator's "
        "certificate: connect with TLS; empty = plaintext",
    )
    parser.add_argument(
        "--tls-cert",
        default="",
        help="PEM client certificate, for an orchestrator that asks for one",
    )
    parser.add_argument("--tls-key", default="", help="PEM key of --tls-cert")
    args = parser.parse_args(argv)
    try:
        credentials = (
            client_credentials(args.tls_ca, args.tls_cert, args.tls_key) if args.tls_ca else None
        )
    except InvalidArgument as error:
        parser.error(str(error))
    stub = orchestrator_pb2_grpc.OrchestratorStub(channel(args.address, credentials=credentials))
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
    try:
        for chunk in stub.GenerateStream(
            build_request(args), timeout=args.timeout, metadata=metadata
        ):
            if chunk.session_id:
                session_id = chunk.session_id
            print(chunk.text_delta, end="", flush=True)
            if chunk.HasField("stats"):
                print()
                print(
                    f"--- session {session_id}, finish: "
                    f"{common_pb2.FinishReason.Name(chunk.finish_reason)}",
                    file=sys.stderr,
                )
                print_stats(chunk.stats)
    except grpc.RpcError as error:
        print(f"\nerror: {error.code().name}: {error.details()}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
