import sys

from orchestrator.server import main

sys.exit(main())
