"""`python -m controller` is the `hotswap` command."""

import sys

from controller.cli import main

sys.exit(main())
