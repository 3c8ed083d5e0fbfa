"""``python -m enginekit``: the ``enginekit`` command."""

import sys

from enginekit.cli import main

sys.exit(main())
