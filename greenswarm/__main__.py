"""``python -m greenswarm`` is the ``greenswarm`` command."""

import sys

from greenswarm.cli import main

sys.exit(main())
