"""``python -m smemguard.cli``: the ``smemguard`` command."""

import sys

from .commands import main

sys.exit(main())
