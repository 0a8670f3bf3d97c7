"""`python -m router`."""

import sys

from router.cli import main

sys.exit(main())
