"""``python -m opsdk.bench``: the ``opsdk bench`` command."""

from __future__ import annotations

import argparse
import sys

from . import add_bench_arguments, run_bench_command


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the benchmark."""
    p = argparse.ArgumentParser(prog="opsdk bench", description=__doc__.split("\n")[0])
    add_bench_arguments(p)
    return run_bench_command(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
