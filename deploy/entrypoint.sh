#!/bin/sh
# The container's entrypoint: the first argument picks the role, the rest are its flags.
#   target        -> python -m target_service   (port 50051)
#   draft         -> python -m draft_service    (port 50052)
#   orchestrator  -> python -m orchestrator     (port 50050, the public gRPC API)
#   http          -> python -m http_api         (port 8000, the OpenAI-compatible HTTP API)
#   ranks         -> python -m model_runtime.tensor_parallel (a node's tensor-parallel ranks
#                    after the leader's: a LeaderWorkerSet worker pod; no port of its own)
# Every flag can also come from the environment: TARGET_*, DRAFT_*, ORCHESTRATOR_*, HTTP_API_*.
set -eu

usage() {
    echo "usage: <image> target|draft|orchestrator|http|ranks [flags]   (<image> ROLE --help lists the flags)" >&2
}

if [ "$#" -eq 0 ]; then
    usage
    exit 2
fi
role="$1"
shift
case "$role" in
    target) module=target_service ;;
    draft) module=draft_service ;;
    orchestrator) module=orchestrator ;;
    http) module=http_api ;;
    ranks) module=model_runtime.tensor_parallel ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown role '$role'" >&2; usage; exit 2 ;;
esac
# exec: the service is PID 1 and receives SIGTERM itself (it then reports NOT_SERVING
# on the health service and lets calls in flight finish within its --grace-s).
exec python -m "$module" "$@"
