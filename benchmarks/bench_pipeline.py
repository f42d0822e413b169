"""`python benchmarks/bench_pipeline.py [--json] [--quick]` (also `ttflow bench pipeline`)."""

import sys

from ttflow.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "pipeline", *sys.argv[1:]]))
