"""`python -m weight_transfer.cli`: the same as the `weight-transfer` command."""

import sys

from weight_transfer.cli import main

sys.exit(main())
