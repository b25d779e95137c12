"""`python -m inflight.cli ...` is `inflight ...`."""

import sys

from inflight.cli import main

sys.exit(main())
