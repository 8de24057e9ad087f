"""``python -m opsdk``: the same as the ``opsdk`` command."""

import sys

from .cli import main

sys.exit(main())
