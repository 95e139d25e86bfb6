import sys

from speculative.cli import main

sys.exit(main())
