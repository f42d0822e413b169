"""`python benchmarks/bench_torch.py [--json] [--quick]`: PyTorch on tt vs CPU torch (also `ttflow bench torch`)."""

import sys

from ttflow.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "torch", *sys.argv[1:]]))
