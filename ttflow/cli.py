"""The `ttflow` command: `ttflow demo`, `ttflow bench {kernels,dispatch,pipeline,decode,torch}`, `ttflow --version`."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

BENCHMARKS = {
    "kernels": "ttflow._bench.kernels",
    "dispatch": "ttflow._bench.dispatch",
    "pipeline": "ttflow._bench.pipeline",
    "decode": "ttflow._bench.decode",
    "torch": "ttflow._bench.torch_step",
}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _blas_threads(text: str) -> int | None:
    if text == "default":
        return None
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a number of threads (at least 1) or 'default', got {text!r}"
        ) from None


def _version() -> str:
    from . import __version__

    return __version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ttflow", description="A runtime for device-resident tensors on an emulated accelerator."
    )
    parser.add_argument("--version", action="version", version=f"ttflow {_version()}")
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
    demo.add_argument("--batches", type=_positive_int, default=64, metavar="N",
                      help="input batches to run, at least 1 (default 64)")
    demo.add_argument("--trace", metavar="FILE",
                      help="write a Chrome/Perfetto trace-event JSON to FILE; missing folders "
                      "on its path are created")
    demo.add_argument("--small", action="store_true", help="use the tiny test device and sizes")
    demo.add_argument("--no-progress", action="store_true",
                      help="no progress bar (it is drawn only when stderr is a terminal)")
    demo.add_argument("--blas-threads", type=_blas_threads, default=1, metavar="N",
                      help="threads numpy's BLAS may use while the device is open, or 'default' "
                      "for the library's own setting (default 1; see docs/performance.md)")
    parser.set_defaults(subparser=None)
    demo.set_defaults(subparser=demo)
    return parser


def _prepare_trace(parser: argparse.ArgumentParser, trace: str) -> None:
    """Checks the trace path before anything runs; creates its missing folders."""
    path = Path(trace)
    if path.is_dir():
        parser.error(f"argument --trace: {trace} is a folder; give a file name, e.g. {path / 'demo.json'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"argument --trace: cannot create the folder {path.parent}: {exc.strerror or exc}")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        parser.error(f"argument --trace: cannot write {trace}: permission denied")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        module = importlib.import_module(BENCHMARKS[args.suite])
        result = module.run(**({"quick": True} if args.quick else {})) if _takes_quick(module) else module.run()
        print(json.dumps(result, indent=2) if args.json else module.format_table(result))
        return 0
    if args.trace is not None:
        _prepare_trace(args.subparser, args.trace)
    from ._demo import run_demo

    return run_demo(batches=args.batches, trace=args.trace, small=args.small,
                    progress=not args.no_progress, blas_threads=args.blas_threads)


def _takes_quick(module: object) -> bool:
    import inspect

    return "quick" in inspect.signature(module.run).parameters  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
