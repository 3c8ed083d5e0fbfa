"""``python -m enginekit.cli``: the ``enginekit`` command."""

import sys

from enginekit.cli import main

sys.exit(main())
