"""`python benchmarks/bench_decode.py [--json] [--quick]`: the decode benchmark (also `ttflow bench decode`)."""

import sys

from ttflow.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "decode", *sys.argv[1:]]))
