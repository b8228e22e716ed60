"""``python -m polyspec``: the same as the ``polyspec`` command."""

import sys

from polyspec.cli import main

sys.exit(main())
