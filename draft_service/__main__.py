"""`python -m draft_service --help`"""

import sys

from draft_service.server import main

sys.exit(main())
