"""``python -m epd.cli ...``: the ``epd`` command line."""

import sys

from epd.cli.main import main

sys.exit(main())
