"""The `ttflow` command: `ttflow demo`, `ttflow memory`, `ttflow bench SUITE`, `ttflow golden FILE.ttb`,
`ttflow query [--save-artifacts DIR]`, `ttflow --version`.

The parser imports nothing of ttflow's runtime: `ttflow --help`, a typo or a bad argument is
answered before numpy, ml_dtypes or the device model load. Each command's handler imports what it
runs. Exit codes: 0 done, 1 the command ran and found a failure (`golden`: an op over its bound),
2 a usage error (argparse's rule: nothing ran).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# suite -> (module, what it measures): `ttflow bench --help` lists these words.
BENCHMARKS = {
    "kernels": ("ttflow._bench.kernels",
                "tilize, untilize, page scatter/gather and BFLOAT8_B packing, GB/s against np.copyto"),
    "dispatch": ("ttflow._bench.dispatch",
                 ("per-program cost of a chain of tiny programs, untraced and replayed, against "
                  "PyTorch eager and numpy")),
    "pipeline": ("ttflow._bench.pipeline",
                 ("double buffering's overlap of writes and programs, stitching against a host "
                  "round trip, resident weights against pushed each time")),
    "decode": ("ttflow._bench.decode",
               "greedy decoding of examples/gpt_decode.py's model on the device against numpy"),
    "torch": ("ttflow._bench.torch_step",
              ("a PyTorch training step and eager ops on tt against CPU torch (needs torch); "
               "--models: Hugging Face and torchvision models")),
    "memory": ("ttflow._bench.memory",
               "the L1 eviction policies' bytes moved against each other and the offline optimum"),
    "compiled": ("ttflow._bench.compiled",
                 ("tt-mlir binaries of the corpus: load time per binary, warm run against the same "
                  "function jitted by JAX on the CPU")),
    "jax": ("ttflow._bench.jax_path",
            ("JAX functions through ttflow.jax.jit: compile, first and warm call against jax.jit on "
             "the CPU, a warm call's host overhead beyond the program's run (needs the jax extra)")),
    "mesh": ("ttflow._bench.mesh",
             ("collectives' bytes per link against their formula and modelled time, SPMD submit "
              "cost against one chip, the tensor-parallel MLP on 1, 2 and 8 chips against numpy")),
}

TORCH_INSTALL = ('pip install ".[torch]" --extra-index-url https://download.pytorch.org/whl/cpu '
                 "from the ttflow checkout")

# What each policy does, in the words `ttflow demo --help` prints (docs/memory.md has the whole
# rule); a test checks these name exactly the policies the device takes.
EVICTION_POLICY_SUMMARIES = {
    "lookahead": "only when an allocation needs the room, the tensor used farthest ahead first",
    "eager": "before each program, every L1 tensor it does not read (the first ttflow's rule)",
}
EVICTION_POLICIES = tuple(EVICTION_POLICY_SUMMARIES)
"""`ttflow._sched.EVICTION_POLICIES`, default first, spelled here so that parsing imports no
scheduler (tests/test_docs.py checks the two agree)."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# `ttflow query --device`: the emulated systems a system descriptor is written for.
QUERY_DEVICES = {
    "n150": "one Wormhole (tt.DeviceSpec.wormhole_n150())",
    "p150": "one Blackhole (tt.DeviceSpec.blackhole_p150())",
    "n300": "two Wormholes on one card, 1x2 (tt.MeshSpec.n300())",
    "t3000": "eight Wormholes, 2x4 (tt.MeshSpec.t3000())",
    "galaxy": "32 Wormholes, 4x8 (tt.MeshSpec.galaxy())",
    "small": "the tiny test device (tt.DeviceSpec.small())",
}

WORKER_KINDS = ("thread", "process", "ray")
from .ttnn import INITS as TTNN_INITS  # noqa: E402  (light: names only)
from .ttnn import SECTIONS as TTNN_SECTIONS  # noqa: E402
"""What `ttflow bench --workers` takes (`tt.open_device(workers=...)`)."""


def _worker_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in WORKER_KINDS]
    if not kinds or unknown:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(WORKER_KINDS)}, got {text!r}")
    return kinds


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
    bench = commands.add_parser(
        "bench", help="run a benchmark and print its figures",
        description="Runs one benchmark and prints its figures, each beside a peer measured in\n"
        "the same run (docs/performance.md says what each figure means).",
        epilog="suites:\n" + "\n".join(f"  {name:<9} {about}" for name, (_, about) in BENCHMARKS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("suite", choices=list(BENCHMARKS), help="which benchmark to run (below)")
    bench.add_argument("--json", action="store_true", help="print the result as JSON")
    bench.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke test")
    bench.add_argument("--workers", type=_worker_kinds, metavar="KINDS",
                       help="with mesh or torch: a comma-separated list of chip worker kinds "
                       f"({', '.join(WORKER_KINDS)}), measured against each other in the same run "
                       "(mesh: chains of small programs, the tensor-parallel MLP and the submit "
                       "call on a 1x2 mesh; torch: the suite once per kind); docs/workers.md")
    bench.add_argument("--models", action="store_true",
                       help="with torch: the model test bed (Hugging Face and torchvision models) "
                       "instead of the MLP step (needs the models extra)")
    demo = commands.add_parser(
        "demo",
        help="run a small pipeline on the emulated n150 and summarise what the runtime did",
        description="Runs a small MLP pipeline on an emulated Wormhole n150: weights pushed once "
        "and kept resident, two programs stitched on the device, double-buffered inputs, weights "
        "converted to the programs' layouts once. Prints a summary table (evictions, "
        "conversions, bytes moved, queue overlap, the error against numpy) and the memory views.",
    )
    demo.add_argument("--batches", type=_positive_int, default=64, metavar="N",
                      help="input batches to run, at least 1 (default 64)")
    demo.add_argument("--trace", metavar="FILE",
                      help="write a Chrome/Perfetto trace-event JSON to FILE; missing folders "
                      "on its path are created")
    demo.add_argument("--memory-map", metavar="FILE",
                      help="draw where every L1 and DRAM buffer sat, command by command, as a "
                      "PNG in FILE (needs matplotlib: pip install '.[plot]' from the ttflow checkout); "
                      "missing folders on its path are created")
    demo.add_argument("--small", action="store_true", help="use the tiny test device and sizes")
    demo.add_argument("--no-progress", action="store_true",
                      help="no progress bar (it is drawn only when stderr is a terminal)")
    demo.add_argument("--blas-threads", type=_blas_threads, default=1, metavar="N",
                      help="threads numpy's BLAS may use while the device is open, or 'default' "
                      "for the library's own setting (default 1; see docs/performance.md)")
    demo.add_argument("--eviction", choices=EVICTION_POLICIES, default=EVICTION_POLICIES[0],
                      help="when L1 tensors move to DRAM: " + "; ".join(
                          f"{name}{' (the default)' if name == EVICTION_POLICIES[0] else ''}: {about}"
                          for name, about in EVICTION_POLICY_SUMMARIES.items())
                      + " (docs/memory.md)")
    memory = commands.add_parser(
        "memory",
        help="run a few batches of the demo pipeline and print what L1 and DRAM hold",
        description="Runs a few batches of the demo's pipeline on an emulated Wormhole n150, "
        "keeping every batch's output, and prints the L1 and DRAM memory views: totals, the "
        "largest free block, fragmentation and every buffer with its kind (device.memory_view).",
    )
    memory.add_argument("--small", action="store_true", help="use the tiny test device and sizes")
    memory.add_argument("--json", action="store_true", help="print the views as JSON")
    golden = commands.add_parser(
        "golden",
        help="run a program of a .ttb file with every op compared against float64 on the host",
        description="Loads a binary, makes seeded random inputs for one of its programs, runs it on an "
        "emulated device and compares every op with the same op in float64 on the host "
        "(tt.compare_with_golden): per op PCC, max abs and relative error and the bound its dtype "
        "allows; the first op over its bound is named with its location. Exits 1 when one is (or "
        "the program fails on the device), 2 when the file is not a binary or does not hold the "
        "--program asked for.",
    )
    golden.add_argument("file", help="a binary written by tt.Binary.save (.ttb)")
    golden.add_argument("--program", type=int, default=0, help="which program of the binary (default 0)")
    golden.add_argument("--substitute", action="store_true",
                        help="replace each op's output by its golden before the next op reads it (isolation)")
    golden.add_argument("--seed", type=int, default=0, help="the random inputs' seed (default 0)")
    golden.add_argument("--json", action="store_true", help="print the report as JSON")
    golden.add_argument("--plot", metavar="PNG", help="also draw each op's error against its bound (needs matplotlib)")
    golden.add_argument("--small", action="store_true", help="run on the tiny test device")
    query = commands.add_parser(
        "query",
        help="print the system descriptor of an emulated device; save it for tt-mlir",
        description="Prints the system descriptor tt-mlir's compiler plans against, for the "
        "device ttflow emulates (ttrt query's counterpart); --save-artifacts writes it to "
        "DIR/system_desc.ttsys, the file TT_COMPILE_ONLY_SYSTEM_DESC takes (docs/compiler.md).",
        epilog="devices:\n" + "\n".join(f"  {name:<7} {about}" for name, about in QUERY_DEVICES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    query.add_argument("--device", choices=list(QUERY_DEVICES), default="n150",
                       help="which emulated system (default n150; below)")
    query.add_argument("--save-artifacts", nargs="?", const="ttrt-artifacts", metavar="DIR",
                       help="write DIR/system_desc.ttsys (DIR default ttrt-artifacts, created "
                       "when missing)")
    query.add_argument("--json", action="store_true", help="print every field as JSON")
    read = commands.add_parser(
        "read", help="print a tt-mlir binary's programs, layouts, ops and the system it was compiled for",
        description="Reads a .ttnn flatbuffer Tenstorrent's compiler wrote (ttrt read's counterpart) "
        "and prints its sections: version (schema hash), system_desc, mlir, programs, inputs and "
        "outputs with the layouts the compiler chose, ops with their locations (docs/compiler.md).",
    )
    read.add_argument("binary", help="a .ttnn file")
    read.add_argument("--section", action="append", choices=list(TTNN_SECTIONS), metavar="SECTION",
                      help=f"a section to print (repeatable; default all but mlir): {', '.join(TTNN_SECTIONS)}")
    read.add_argument("--json", action="store_true", help="print the sections as JSON")
    run = commands.add_parser(
        "run", help="run a tt-mlir binary's programs on the emulated device and report each",
        description="Loads a .ttnn flatbuffer (or a .ttb), makes inputs, runs each public program "
        "(or --program-index) --loops times on an emulated device (a mesh of the binary's shape for "
        "a mesh program) and prints per program the time per loop, every output's shape, dtype and "
        "checksum, and with --memory the peak L1 and DRAM the run held (ttrt run's counterpart).",
    )
    run.add_argument("binary", help="a .ttnn file")
    run.add_argument("--program-index", type=int, default=None, metavar="N",
                     help="run only program N (default: every public program)")
    run.add_argument("--loops", type=_positive_int, default=1, metavar="N", help="runs per program (default 1)")
    run.add_argument("--init", choices=list(TTNN_INITS), default="randn",
                     help="how inputs are made when --inputs does not give them (default randn)")
    run.add_argument("--seed", type=int, default=0, help="the random inputs' seed (default 0)")
    run.add_argument("--inputs", metavar="NPZ", help="inputs as in0, in1, ... (per chip: in0_chip1)")
    run.add_argument("--save-outputs", metavar="NPZ", help="write every output to NPZ")
    run.add_argument("--memory", action="store_true", help="report peak L1 (per core) and DRAM")
    run.add_argument("--trace", metavar="FILE", help="write a Perfetto timeline of the runs to FILE")
    run.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(subparser=None)
    demo.set_defaults(subparser=demo, handler=_run_demo)
    bench.set_defaults(subparser=bench, handler=_run_bench)
    memory.set_defaults(subparser=memory, handler=_run_memory)
    golden.set_defaults(subparser=golden, handler=_run_golden)
    query.set_defaults(subparser=query, handler=_run_query)
    read.set_defaults(subparser=read, handler=_run_read)
    run.set_defaults(subparser=run, handler=_run_run)
    return parser


def _prepare_output(parser: argparse.ArgumentParser, option: str, file: str, example: str) -> None:
    """Checks an output path before anything runs; creates its missing folders."""
    path = Path(file)
    if path.is_dir():
        parser.error(f"argument {option}: {file} is a folder; give a file name, e.g. {path / example}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"argument {option}: cannot create the folder {path.parent}: {exc.strerror or exc}")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        parser.error(f"argument {option}: cannot write {file}: permission denied")


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _prepare_memory_map(parser: argparse.ArgumentParser, file: str) -> None:
    """Fails before the demo runs, not after, when the map could not be drawn."""
    if not _has_matplotlib():
        parser.error("argument --memory-map: drawing the map needs matplotlib: "
                     "pip install '.[plot]' from the ttflow checkout")
    _prepare_output(parser, "--memory-map", file, "memory.png")


def _run_bench(args: argparse.Namespace) -> int:
    parser = args.subparser
    if args.suite == "torch" and importlib.util.find_spec("torch") is None:
        parser.error("bench torch needs PyTorch: " + TORCH_INSTALL)
    if args.models and args.suite != "torch":
        parser.error(f"--models goes with bench torch, not bench {args.suite}")
    if args.models and importlib.util.find_spec("transformers") is None:
        parser.error("bench torch --models needs transformers: pip install 'transformers>=5,<6'")
    if args.workers is not None and (args.suite not in ("mesh", "torch") or args.models):
        parser.error(f"--workers goes with bench mesh or bench torch, not bench {args.suite}"
                     + (" --models" if args.models else ""))
    if args.workers is not None and "ray" in args.workers and importlib.util.find_spec("ray") is None:
        parser.error("--workers ray needs Ray: pip install '.[ray]' from the ttflow checkout")
    if args.workers is not None and args.suite == "mesh":
        module = importlib.import_module("ttflow._bench.workers")
        result = module.run(quick=args.quick, workers=args.workers)
    elif args.workers is not None:
        module = importlib.import_module(BENCHMARKS[args.suite][0])
        result = module.run(quick=args.quick, workers=args.workers)
    else:
        module = importlib.import_module("ttflow._bench.torch_models" if args.models else BENCHMARKS[args.suite][0])
        result = module.run(quick=args.quick)
    print(json.dumps(result, indent=2) if args.json else module.format_table(result))
    return 0


def _run_memory(args: argparse.Namespace) -> int:
    from ._demo import run_memory

    return run_memory(small=args.small, as_json=args.json)


def _run_golden(args: argparse.Namespace) -> int:
    parser = args.subparser
    if args.plot is not None:
        if not _has_matplotlib():
            parser.error("argument --plot: drawing needs matplotlib: pip install '.[plot]' "
                         "from the ttflow checkout")
        _prepare_output(parser, "--plot", args.plot, "golden.png")
    from ._ir.binary import Binary
    from ._errors import TTFlowError
    from ._golden import run_file

    # A file that is not a binary, or a program it does not hold, is a usage error (2), as an
    # argument argparse refuses is: 1 is kept for a run that found an op over its bound.
    try:
        binary = Binary.load(args.file)
    except (OSError, TTFlowError) as exc:
        parser.error(f"argument file: {exc}")
    count = len(binary.programs)
    if not 0 <= args.program < count:
        parser.error(f"argument --program: {args.program} is out of range: {args.file} holds "
                     f"{count} program{'' if count == 1 else 's'} (--program 0"
                     f"{'' if count == 1 else f' to {count - 1}'})")
    return run_file(args.file, program_index=args.program, substitute=args.substitute, seed=args.seed,
                    as_json=args.json, plot=args.plot, small=args.small)


def _run_read(args: argparse.Namespace) -> int:
    from ._errors import TTFlowError
    from .ttnn import tool

    sections = args.section or [s for s in TTNN_SECTIONS if s != "mlir"]
    try:
        data = tool.read_sections(args.binary, sections)
    except (OSError, TTFlowError) as exc:
        args.subparser.error(f"argument binary: {exc}")
    print(tool.dumps(data) if args.json else tool.format_sections(data))
    return 0


def _run_run(args: argparse.Namespace) -> int:
    import anyio

    from ._errors import TTFlowError
    from .ttnn import tool

    for option, file in (("--save-outputs", args.save_outputs), ("--trace", args.trace)):
        if file is not None:
            _prepare_output(args.subparser, option, file, "out.npz" if option == "--save-outputs" else "trace.json")
    try:
        binary = tool.read_sections(args.binary, ["programs"])
    except (OSError, TTFlowError) as exc:
        args.subparser.error(f"argument binary: {exc}")
    count = len(binary["programs"])
    if args.program_index is not None and not 0 <= args.program_index < count:
        args.subparser.error(f"argument --program-index: {args.program_index} is out of range: "
                             f"{args.binary} holds {count} programs (0 to {count - 1})")
    try:
        report = anyio.run(lambda: tool.run_binary(
            args.binary, program_index=args.program_index, loops=args.loops, init=args.init, seed=args.seed,
            inputs=args.inputs, save_outputs=args.save_outputs, trace=args.trace))
    except TTFlowError as exc:
        print(f"ttflow run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(tool.dumps(report) if args.json else tool.format_run(report, args.memory))
    return 0


def _run_query(args: argparse.Namespace) -> int:
    folder = None if args.save_artifacts is None else Path(args.save_artifacts)
    if folder is not None:
        if folder.exists() and not folder.is_dir():
            args.subparser.error(f"argument --save-artifacts: {folder} is a file; give a folder")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            args.subparser.error(f"argument --save-artifacts: cannot create the folder {folder}: "
                                 f"{exc.strerror or exc}")
    from ._mesh.spec import MeshSpec
    from ._types import DeviceSpec
    from .ttnn import system_desc

    presets: dict[str, Callable[[], DeviceSpec | MeshSpec]] = {
        "n150": DeviceSpec.wormhole_n150, "p150": DeviceSpec.blackhole_p150, "n300": MeshSpec.n300,
        "t3000": MeshSpec.t3000, "galaxy": MeshSpec.galaxy, "small": DeviceSpec.small}
    spec = presets[args.device]()
    desc = system_desc(spec)
    print(json.dumps(desc.to_dict(), indent=2) if args.json else desc.summary())
    if folder is not None:
        print(f"wrote {desc.save(folder / 'system_desc.ttsys')}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    if args.trace is not None:
        _prepare_output(args.subparser, "--trace", args.trace, "demo.json")
    if args.memory_map is not None:
        _prepare_memory_map(args.subparser, args.memory_map)
    from ._demo import run_demo

    return run_demo(batches=args.batches, trace=args.trace, small=args.small,
                    progress=not args.no_progress, blas_threads=args.blas_threads,
                    memory_map=args.memory_map, eviction=args.eviction)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
