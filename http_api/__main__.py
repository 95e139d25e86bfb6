import sys

from http_api.server import main

sys.exit(main())
