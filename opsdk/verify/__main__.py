"""``python -m opsdk.verify``: the same as ``opsdk verify``."""

import argparse
import sys

from ._cli import add_verify_arguments, run_verify_command

parser = argparse.ArgumentParser(prog="opsdk verify", description=__doc__)
add_verify_arguments(parser)
sys.exit(run_verify_command(parser.parse_args()))
