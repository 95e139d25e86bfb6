"""`python -m launcher`: target, draft, orchestrator and the HTTP API as local processes, health-checked.

    python -m launcher                          # serve until Ctrl-C (HTTP API and playground on :8000)
    python -m launcher --prompt "Hello"         # start, generate once through the client, stop

Each role is the same module a container runs (`python -m target_service`, ...), with
the same flags; logs go to --log-dir.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from launcher.cluster import Cluster, layout, parse_args, start_system, tls_files


def main(argv=None) -> int:
    args = parse_args(argv)
    cluster = Cluster(Path(args.log_dir))
    try:
        print(
            f"starting target ({args.target_model}), draft ({args.draft_model or 'n-gram'}), orchestrator, HTTP API; "
            f"logs in {args.log_dir}",
            file=sys.stderr,
        )
        started = time.monotonic()
        roles = layout(args)
        address = start_system(args, cluster, roles)
        print(
            f"ready in {time.monotonic() - started:.0f} s: orchestrator at {address}",
            file=sys.stderr,
        )
        for role in (r for r in roles if r.pool == "http"):
            print(
                f"OpenAI-compatible HTTP API at http://{role.address}/v1, playground at http://{role.address}/",
                file=sys.stderr,
            )
        tls = tls_files(args)
        if tls:
            print(
                f"TLS: python -m client PROMPT --address {address} --tls-ca {tls['client'].ca}",
                file=sys.stderr,
            )
        if args.prompt is not None:
            client_args = [a for a in args.client_args if a != "--"]
            if tls:
                client_args += ["--tls-ca", tls["client"].ca]
            return subprocess.call(
                [sys.executable, "-m", "client", args.prompt, "--address", address, *client_args]
            )
        stop = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        stop.wait()
        return 0
    finally:
        cluster.stop()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
