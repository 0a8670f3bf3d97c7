"""`python -m server ...` runs `jaxserve serve ...`."""

import sys

from server.cli import main

sys.exit(main())
