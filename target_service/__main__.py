"""`python -m target_service --model tiny-random:1 --address 127.0.0.1:0` (see --help)."""

from target_service.server import main

raise SystemExit(main())
