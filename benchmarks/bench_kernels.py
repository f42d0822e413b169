"""`python benchmarks/bench_kernels.py [--json] [--quick] [--size N] [--repeats R]`.

The kernel benchmark of docs/performance.md (also `ttflow bench kernels`); the code lives in
`ttflow._bench.kernels`.
"""

import argparse
import json

from ttflow._bench import kernels

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--quick", action="store_true", help="512x512, 2 repeats: a smoke test")
    parser.add_argument("--size", type=int, default=4096, help="array edge (default 4096)")
    parser.add_argument("--repeats", type=int, default=5, help="best of this many (default 5)")
    args = parser.parse_args()
    result = kernels.run(args.size, args.repeats, quick=args.quick)
    print(json.dumps(result, indent=2) if args.json else kernels.format_table(result))
