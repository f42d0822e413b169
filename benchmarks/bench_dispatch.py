"""`python benchmarks/bench_dispatch.py [--json] [--quick]`: the dispatch benchmark (also `ttflow bench dispatch`)."""

import sys

from ttflow.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "dispatch", *sys.argv[1:]]))
