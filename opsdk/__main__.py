"""``python -m opsdk``: the same as the ``opsdk`` command."""

import sys

try:  # Ctrl-C while the command's modules import: a word and 130, as main() answers it
    from .cli import console
except KeyboardInterrupt:
    sys.stderr.write("interrupted\n")
    sys.exit(130)

console()
