"""`python -m prefixgym COMMAND ...`: the same as the `prefixgym` command."""

import sys

from prefixgym.cli import main

sys.exit(main())
