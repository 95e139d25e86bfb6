#!/bin/sh
# The container's entrypoint: the first argument picks the role, the rest are its flags.
#   target        -> python -m target_service   (port 50051)
#   draft         -> python -m draft_service    (port 50052)
#   orchestrator  -> python -m orchestrator     (port 50050, the public API)
# Every flag can also come from the environment: TARGET_*, DRAFT_*, ORCHESTRATOR_*.
set -eu

usage() {
    echo "usage: <image> target|draft|orchestrator [flags]   (<image> ROLE --help lists the flags)" >&2
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
    -h|--help) usage; exit 0 ;;
    *) echo "unknown role '$role'" >&2; usage; exit 2 ;;
esac
# exec: the service is PID 1 and receives SIGTERM itself (it then reports NOT_SERVING
# on the health service and lets calls in flight finish within its --grace-s).
exec python -m "$module" "$@"
