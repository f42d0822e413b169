"""The `ttflow` command: `ttflow demo` and `ttflow bench {kernels,dispatch,pipeline}`."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence

BENCHMARKS = {
    "kernels": "ttflow._bench.kernels",
    "dispatch": "ttflow._bench.dispatch",
    "pipeline": "ttflow._bench.pipeline",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ttflow", description="A runtime for device-resident tensors on an emulated accelerator."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="run a benchmark and print its figures")
    bench.add_argument("suite", choices=sorted(BENCHMARKS), help="which benchmark to run")
    bench.add_argument("--json", action="store_true", help="print the result as JSON")
    bench.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke test")
    demo = commands.add_parser(
        "demo",
        help="run a small pipeline on the emulated n150 and summarise what the runtime did",
        description="Runs a small MLP pipeline on an emulated Wormhole n150: weights pushed once "
        "and kept resident, two stitched programs, double-buffered inputs, at least one "
        "eviction and one layout conversion. Prints a summary table.",
    )
    demo.add_argument("--batches", type=int, default=64, help="input batches to run (default 64)")
    demo.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace-event JSON")
    demo.add_argument("--small", action="store_true", help="use the tiny test device and sizes")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "bench":
        module = importlib.import_module(BENCHMARKS[args.suite])
        result = module.run(**({"quick": True} if args.quick else {})) if _takes_quick(module) else module.run()
        print(json.dumps(result, indent=2) if args.json else module.format_table(result))
        return 0
    from ._demo import run_demo

    return run_demo(
        batches=args.batches, trace=args.trace, small=args.small, progress=not args.no_progress
    )


def _takes_quick(module: object) -> bool:
    import inspect

    return "quick" in inspect.signature(module.run).parameters  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
