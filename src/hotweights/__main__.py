"""`python -m hotweights`: the `hotweights` command line."""

import sys

from hotweights.cli.main import main

sys.exit(main())
