"""`python -m hotweights`: the `hotweights` command line."""

import sys

from hotweights.cli import main

sys.exit(main())
