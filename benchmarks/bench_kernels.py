"""`python benchmarks/bench_kernels.py [--json] [--quick]` (also `ttflow bench kernels`)."""

import sys

from ttflow.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "kernels", *sys.argv[1:]]))
