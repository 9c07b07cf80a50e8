"""`python -m openinfer ...` is the `openinfer` console script."""

import sys

from openinfer.entrypoints.cli import main

sys.exit(main())
