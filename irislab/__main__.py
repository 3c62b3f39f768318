"""`python -m irislab`: the `iris-lab` command."""

import sys

from irislab.cli import main

sys.exit(main())
