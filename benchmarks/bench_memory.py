"""`python benchmarks/bench_memory.py [--json] [--quick]`: L1 eviction, eager vs lookahead vs the
offline optimum (also `ttflow bench memory` once registered); the code lives in
`ttflow._bench.memory`.
"""

import argparse
import json

from ttflow._bench import memory

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--quick", action="store_true", help="the small test device and sizes: a smoke test")
    args = parser.parse_args()
    result = memory.run(quick=args.quick)
    print(json.dumps(result, indent=2) if args.json else memory.format_table(result))
