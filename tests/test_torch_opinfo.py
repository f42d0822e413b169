"""PyTorch's own OpInfo database (`op_db`) as ttflow.torch's conformance suite, as PyTorch asks
of an out-of-tree backend: each op's sample inputs, moved to tt, against the same op on the CPU.

For every op of `torch.testing._internal.common_methods_invocations.op_db` and each of float32,
int64, int32 and bool that the op supports on the CPU (a *case*: op, variant, dtype), the first
`SAMPLES` sample inputs are drawn on the CPU (seeded), every tensor in them (input, args,
kwargs, nested lists) is copied to tt, and the op's results, moved back, must equal the CPU's:
shapes, dtypes and the device "tt" exactly, integers and bools exactly, floats within the
OpInfo's own tolerance or `FLOAT32` (the wider), NaN equal to NaN. For float32 and an op that
`supports_autograd`, the same samples with `requires_grad` inputs are differentiated on both
devices with one fixed random upstream gradient (`torch.autograd.grad`) and compared alike.

Each case ends in one outcome, from best to worst:

    device    ran on tt, no CPU-fallback warning
    fallback  right, but some op ran on the CPU (the fallback's "... ran on the CPU" warning)
    refused   raised a typed error: a `ttflow.TTFlowError` (`UnsupportedOpError` is one) or
              torch's `NotImplementedError`, where the CPU ran the sample
    crash     raised any other exception (a bug), killed its process (a segfault) or hung
    wrong     a value, shape, dtype or device differs from the CPU's and nothing was raised

`tests/data/opinfo_expected.py` lists every case whose outcome is not "device" (`EXPECTED`),
with a one-line reason, and the test fails when a case does worse *or better* than listed,
printing the line to add, change or remove, so the list stays true. "wrong" and "crash" are
never expected outcomes: those cases are in its separate `KNOWN_BUGS` and run as
`xfail(strict=True)` tests, which fail once the bug is fixed (or changes).

Every case runs in one of a few worker processes (this file run as a script with `--worker`),
never in the pytest process: an op that segfaults (fft's complex results were reported to)
or hangs costs its worker, which is restarted, and the case is recorded as a crash. The
workers run side by side, one per core.

The `long` hypothesis profile (`HYPOTHESIS_PROFILE=long`) runs every case; any other profile
(`ci`, the default, and `dev`) runs a fixed subset: the ops whose name hashes into one
`CI_SHARE`-th of the database, plus every known bug, with the same samples (so the same
expected outcomes hold). To measure the whole database and print a fresh expected list:

    python tests/test_torch_opinfo.py --measure results.json      # every case, ~2 min on 2 cores
    python tests/test_torch_opinfo.py --write-expected results.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
EXPECTED_FILE = HERE / "data" / "opinfo_expected.py"

SAMPLES = 4
"""Sample inputs per op and dtype (the first ones an OpInfo yields, seeded)."""

DTYPES = ("float32", "int64", "int32", "bool")

FLOAT32 = {"rtol": 1e-5, "atol": 1e-5}
"""The float32 tolerance where an OpInfo gives none wider: about 80 ulps relative, torch's own
default for float32 (`assert_close`'s 1.3e-6, 10 ulps) widened for gradients that sum large
terms which cancel (pow's exponent gradient sums terms near 1e4 to -404.72, and the device's
order of summation lands 30 ulps from the CPU's). Over the whole database, forward results stay
within 3 of torch's default units of the CPU's (`--measure` reports each case's worst as
"error"); a real error (an off-by-one index, a wrong axis, a lost term) is far outside either."""

WIDER = {
    "nn.functional.layer_norm": ({"rtol": 1e-5, "atol": 1e-4},
                                 ("a one-element layer norm: x - mean is 0, and the CPU's weight gradient is "
                                  "its rounding noise times 1/sqrt(eps) (1.8e-5; tt's is 0)")),
    "linalg.householder_product": ({"rtol": 1e-5, "atol": 1e-4},
                                   ("its gradient chains products of values up to 15, and one element cancels "
                                    "to near 0: 1.8e-5 apart is ~20 ulps of the terms")),
}
"""Documented tolerances wider than `FLOAT32` and the OpInfo's, per op, each with its reason."""

OUTCOMES = ("device", "fallback", "refused", "crash", "wrong")
"""Best to worst."""

CASE_TIMEOUT = 120.0
"""Seconds one case may take in a worker before it counts as hung (a crash)."""

CI_SHARE = 4
"""The `ci` profile runs the ops whose name's crc32 is 0 modulo this (about a quarter)."""

WORKERS = int(os.environ.get("TTFLOW_OPINFO_WORKERS", "0")) or min(os.cpu_count() or 1, 4)

# The OpInfo skip reasons of `TestCommon.test_compare_cpu` (PyTorch's own CPU-vs-device test)
# whose values no device can be held to: for these, shapes, dtypes and devices are compared.
_UNCOMPARABLE = ("non-deterministic", "undefined", "Overflow when downcasting")


# -- the cases -----------------------------------------------------------------------------------


@functools.cache
def load_expected() -> tuple[dict[tuple[str, str, str], tuple[str, str]], dict[tuple[str, str, str], tuple[str, str]]]:
    """(EXPECTED, KNOWN_BUGS) from tests/data/opinfo_expected.py."""
    spec = importlib.util.spec_from_file_location("opinfo_expected", EXPECTED_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EXPECTED, module.KNOWN_BUGS


def case_id(case: tuple[str, str, str]) -> str:
    name, variant, dtype = case
    return f"{name}{'.' + variant if variant else ''}-{dtype}"


def in_ci(name: str) -> bool:
    return zlib.crc32(name.encode()) % CI_SHARE == 0


def all_cases() -> list[tuple[str, str, str]]:
    """Every (op name, variant, dtype) of op_db, in op_db's order."""
    from torch.testing._internal.common_methods_invocations import op_db

    cases = []
    for op in op_db:
        supported = {str(d).removeprefix("torch.") for d in op.supported_dtypes("cpu")}
        cases += [(op.name, op.variant_test_name, d) for d in DTYPES if d in supported]
    return cases


# -- one case, inside a worker ------------------------------------------------------------------


def _find_op(name: str, variant: str) -> Any:
    from torch.testing._internal.common_methods_invocations import op_db

    return next(op for op in op_db if op.name == name and op.variant_test_name == variant)


def _uncomparable(op: Any) -> str:
    """The OpInfo's own reason its values cannot be compared across devices, or ""."""
    if "empty" in op.name:  # empty, empty_like, new_empty, empty_strided, empty_permuted
        return "uninitialised memory"
    for info in op.decorators:
        if getattr(info, "test_name", None) != "test_compare_cpu" or getattr(info, "device_type", None) not in (None, "cpu"):
            continue
        for decorator in info.decorators:
            if getattr(decorator, "__qualname__", "").startswith("skip."):
                reason = str(decorator.__closure__[0].cell_contents)
                if any(word in reason for word in _UNCOMPARABLE):
                    return reason
    return ""


def _tolerance(op: Any) -> dict[str, float]:
    """`FLOAT32` (or the op's `WIDER`), widened to the OpInfo's own float32 tolerance overrides
    (`toleranceOverride`, `precisionOverride`, for any of PyTorch's tests)."""
    import torch

    base = WIDER[op.name][0] if op.name in WIDER else FLOAT32
    rtol, atol = base["rtol"], base["atol"]
    for info in op.decorators:
        if getattr(info, "device_type", None) not in (None, "cpu"):
            continue
        for decorator in getattr(info, "decorators", ()):
            override = getattr(decorator, "d", None)
            if not isinstance(override, dict) or torch.float32 not in override:
                continue
            given = override[torch.float32]  # toleranceOverride's `tol`, or precisionOverride's atol
            rtol = max(rtol, getattr(given, "rtol", 0.0))
            atol = max(atol, getattr(given, "atol", given if isinstance(given, float) else 0.0))
    return {"rtol": rtol, "atol": atol}


class _Mismatch(Exception):
    """A result that differs from the CPU's (the case is "wrong")."""


_CPU_ARGUMENTS = {"tensor_split": 0}
"""Ops with a tensor argument torch requires on the CPU (the position in `sample.args`), which
the OpInfo's samples make there on any device: it stays there."""


def _to_tt(op: Any, sample: Any) -> tuple[Any, Any, Any]:
    """(input, args, kwargs) with every tensor a tt copy (one tensor met twice stays one; a
    view is the same view of its base's copy), every CPU device argument tt."""
    import torch

    copies: dict[int, torch.Tensor] = {}

    def tensor(value: torch.Tensor) -> torch.Tensor:
        if id(value) not in copies:
            if value._base is not None and value.layout is torch.strided and not (value.is_conj() or value.is_neg()):
                base = tensor(value._base).detach()
                copy = base.as_strided(value.shape, value.stride(), value.storage_offset())
            else:
                copy = value.detach().resolve_conj().resolve_neg().clone().to("tt")
            copies[id(value)] = copy.requires_grad_(value.requires_grad) if value.is_leaf else copy
        return copies[id(value)]

    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return tensor(value)
        if isinstance(value, torch.device) and value.type == "cpu" or value == "cpu":
            return torch.device("tt") if isinstance(value, torch.device) else "tt"
        if isinstance(value, list):
            return [move(v) for v in value]
        if isinstance(value, tuple):
            return tuple(move(v) for v in value)
        if isinstance(value, dict):
            return {k: move(v) for k, v in value.items()}
        return value

    args = list(sample.args)
    kept = _CPU_ARGUMENTS.get(op.name)
    moved = [a if i == kept else move(a) for i, a in enumerate(args)]
    return move(sample.input), tuple(moved), move(sample.kwargs)


_TIES = ("sort", "argsort", "topk", "kthvalue", "mode", "median", "nanmedian", "max", "min", "cummax",
         "cummin", "msort")
"""Ops whose indices torch leaves unspecified among equal values (a tie may be either index)."""


def _same_up_to_ties(x: Any, got: Any, want: Any) -> bool:
    """Whether indices `got` pick the same values of `x` as `want` along one of its dims."""
    import torch

    if not isinstance(x, torch.Tensor) or got.dtype is not torch.int64:
        return False
    x = x.detach()
    for dim in range(x.ndim):
        g, w = (got.unsqueeze(dim), want.unsqueeze(dim)) if got.ndim == x.ndim - 1 else (got, want)
        if g.ndim != x.ndim:
            continue
        try:
            picked, wanted = x.gather(dim, g), x.gather(dim, w)
            torch.testing.assert_close(picked, wanted, rtol=0, atol=0, equal_nan=True)
        except (RuntimeError, IndexError, AssertionError):
            continue
        # A sort's indices are a permutation.
        return g.shape != x.shape or torch.equal(g.sort(dim).values, w.sort(dim).values)
    return False


def _flat(value: Any) -> list[Any]:
    from torch.utils._pytree import tree_leaves

    return tree_leaves(value)


def _compare(actual: Any, expected: Any, tolerance: dict[str, float], values: bool, where: str,
             ties: Any = None) -> None:
    """Raises `_Mismatch` unless `actual` (tt) is `expected` (CPU): the same structure, and
    each tensor on tt with the CPU's shape and dtype and (if `values`) values; integer indices
    into `ties` may differ where they pick equal values."""
    import torch

    got, want = _flat(actual), _flat(expected)
    if len(got) != len(want):
        raise _Mismatch(f"{where}: {len(got)} results, the CPU gives {len(want)}")
    for index, (a, e) in enumerate(zip(got, want)):
        at = f"{where} result {index}"
        if not isinstance(e, torch.Tensor):
            if isinstance(a, torch.Tensor) or (values and a != e and not _both_nan(a, e)):
                raise _Mismatch(f"{at}: {a!r}, the CPU gives {e!r}")
            continue
        if not isinstance(a, torch.Tensor):
            raise _Mismatch(f"{at}: {type(a).__name__}, the CPU gives a tensor")
        if a.device.type != "tt":
            raise _Mismatch(f"{at}: on {a.device}, not tt")
        if a.shape != e.shape or a.dtype != e.dtype:
            raise _Mismatch(f"{at}: {a.dtype}{list(a.shape)}, the CPU gives {e.dtype}{list(e.shape)}")
        if not values:
            continue
        host = a.detach().cpu()
        exact = not (e.is_floating_point() or e.is_complex())
        tol = {"rtol": 0.0, "atol": 0.0} if exact else tolerance if e.dtype == torch.float32 else {}
        if e.dtype is torch.float32:
            _worst.append(_error(host, e.detach()))
        try:
            torch.testing.assert_close(host, e.detach(), equal_nan=True, check_stride=False, **tol)
        except AssertionError as exc:
            if ties is not None and _same_up_to_ties(ties, host, e):
                continue
            detail = " ".join(line.strip() for line in str(exc).splitlines()[1:4])
            raise _Mismatch(f"{at}: {detail}") from None


_worst: list[float] = []
"""Each float32 comparison's error in units of torch's default float32 tolerance (a
diagnostic: `--measure` reports the worst per case, to choose `FLOAT32`)."""


def _error(actual: Any, expected: Any) -> float:
    differ = ~(actual.isnan() & expected.isnan()) & (actual != expected)
    if not differ.any():
        return 0.0
    a, e = actual[differ].double(), expected[differ].double()
    return float(((a - e).abs() / (1e-5 + 1.3e-6 * e.abs())).nan_to_num(float("inf")).max())


def _both_nan(a: Any, e: Any) -> bool:
    return isinstance(a, float) and isinstance(e, float) and math.isnan(a) and math.isnan(e)


def _differentiable(value: Any) -> list[Any]:
    import torch

    return [t for t in _flat(value) if isinstance(t, torch.Tensor) and t.requires_grad]


def _run_sample(op: Any, sample: Any, tolerance: dict[str, float], values: bool, grad: bool,
                where: str) -> bool:
    """One sample on tt against the CPU; raises `_Mismatch` or the tt side's error. Returns
    False when the CPU itself rejects the sample (it is skipped)."""
    import torch

    tt_input, tt_args, tt_kwargs = _to_tt(op, sample)
    torch.manual_seed(1234)
    try:
        expected = op(sample.input, *sample.args, **sample.kwargs)
        if grad:
            outputs = _differentiable(sample.output_process_fn_grad(expected))
            if not outputs:
                return False
            generator = torch.Generator().manual_seed(5678)
            upstream = [torch.randn(o.shape, generator=generator, dtype=o.dtype) for o in outputs]
            leaves = _differentiable((sample.input, sample.args, sample.kwargs))
            expected = torch.autograd.grad(outputs, leaves, upstream, allow_unused=True)
    except Exception:  # noqa: BLE001 - a sample the CPU rejects says nothing about tt
        return False
    torch.manual_seed(1234)
    actual = op(tt_input, *tt_args, **tt_kwargs)
    if grad:
        tt_outputs = _differentiable(sample.output_process_fn_grad(actual))
        tt_leaves = _differentiable((tt_input, tt_args, tt_kwargs))
        if len(tt_outputs) != len(outputs):
            raise _Mismatch(f"{where}: {len(tt_outputs)} differentiable results, the CPU gives {len(outputs)}")
        actual = torch.autograd.grad(tt_outputs, tt_leaves, [u.to("tt") for u in upstream], allow_unused=True)
    else:
        actual, expected = sample.output_process_fn_grad(actual), sample.output_process_fn_grad(expected)
    import ttflow.torch as ttt

    ttt.synchronize()  # an error queued by this sample belongs to it
    ties = sample.input if not grad and op.name in _TIES else None
    try:
        _compare(actual, expected, tolerance, values, where, ties)
    except _Mismatch:
        if not values or grad:
            raise
        # A random op no seed makes the CPU repeat (the CPU differs from itself): metadata only.
        torch.manual_seed(4321)
        again = sample.output_process_fn_grad(op(sample.input, *sample.args, **sample.kwargs))
        try:
            _compare_cpu(again, expected, tolerance)
        except _Mismatch:
            _compare(actual, expected, tolerance, False, where)
            return True
        raise
    return True


def _compare_cpu(again: Any, expected: Any, tolerance: dict[str, float]) -> None:
    import torch

    for a, e in zip(_flat(again), _flat(expected)):
        if isinstance(e, torch.Tensor):
            try:
                torch.testing.assert_close(a, e, equal_nan=True, check_stride=False)
            except AssertionError:
                raise _Mismatch("the CPU differs from itself") from None


def _samples(op: Any, dtype: Any, requires_grad: bool) -> list[Any]:
    import torch

    torch.manual_seed(0)
    return list(itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=requires_grad), SAMPLES))


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _where_raised(exc: BaseException) -> str:
    """The innermost ttflow frame of a traceback, as file:line (where a bug is)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/ttflow/" in f.filename]
    if not frames:
        return ""
    frame = frames[-1]
    return f" [{frame.filename.rsplit('/ttflow/', 1)[1]}:{frame.lineno}]"


def run_case(name: str, variant: str, dtype_name: str) -> dict[str, Any]:
    """One case's outcome and reason (see the module docstring). Runs in a worker process."""
    import torch

    import ttflow
    from ttflow.torch import _fallback

    op = _find_op(name, variant)
    dtype = getattr(torch, dtype_name)
    tolerance = _tolerance(op)
    uncomparable = _uncomparable(op)
    parts = [(False, _samples(op, dtype, False))]
    if dtype is torch.float32 and op.supports_autograd:
        parts.append((True, _samples(op, dtype, True)))
    _fallback.warned.clear()
    _worst.clear()
    compared = 0
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for grad, samples in parts:
                for index, sample in enumerate(samples):
                    where = f"{'backward' if grad else 'forward'} sample {index}"
                    compared += _run_sample(op, sample, tolerance, not uncomparable, grad, where)
        except _Mismatch as exc:
            return {"outcome": "wrong", "reason": _short(str(exc), 300), "compared": compared}
        except (ttflow.TTFlowError, NotImplementedError) as exc:
            outcome, reason = "refused", f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - any other error is a bug: recorded, not raised
            outcome, reason = "crash", f"{type(exc).__name__}: {exc}{_where_raised(exc)}"
        else:
            outcome, reason = "device", ""
    fallbacks = sorted({_short(str(w.message).split(". Its tt inputs")[0], 200) for w in caught
                        if "ran on the CPU" in str(w.message)})
    if outcome == "device" and fallbacks:
        outcome, reason = "fallback", "; ".join(fallbacks)
    result = {"outcome": outcome, "reason": _short(reason, 300), "compared": compared,
              "seconds": round(time.monotonic() - start, 2)}
    if _worst:
        result["error"] = max(_worst)
    if uncomparable:
        result["values"] = f"not compared: {uncomparable}"
    return result


def worker() -> None:
    """Reads cases (JSON lines) on stdin, writes results (JSON lines) to the original stdout;
    everything else anything prints goes to stderr."""
    import faulthandler

    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    faulthandler.enable()
    import torch
    from torch.testing._internal.common_methods_invocations import op_db  # noqa: F401

    import ttflow.torch  # noqa: F401

    torch.set_num_threads(1)
    results.write(json.dumps({"ready": True}) + "\n")
    results.flush()
    for line in sys.stdin:
        name, variant, dtype = json.loads(line)
        print(f"=== {case_id((name, variant, dtype))}", file=sys.stderr, flush=True)
        try:
            result = run_case(name, variant, dtype)
        except Exception as exc:  # noqa: BLE001 - this file's own bug, not the op's
            result = {"outcome": "crash", "reason": _short(f"the test harness failed: {type(exc).__name__}: {exc}", 300)}
        results.write(json.dumps(result) + "\n")
        results.flush()


# -- the workers, from the pytest process --------------------------------------------------------


class _Worker:
    """One worker process; restarted after it dies or hangs."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[str] | None = None
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - lives as long as the worker; closed by `close`

    def _start(self) -> None:
        self.log.seek(0)
        self.log.truncate()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
        self.process = subprocess.Popen([sys.executable, str(Path(__file__)), "--worker"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        ready = self._read(300.0)
        if ready is None or not ready.get("ready"):
            raise RuntimeError(f"an OpInfo worker did not start:\n{self._log_tail(0)}")

    def _read(self, timeout: float) -> dict[str, Any] | None:
        assert self.process is not None and self.process.stdout is not None
        readable, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not readable:
            return None
        line = self.process.stdout.readline()
        return json.loads(line) if line else None

    def _log_tail(self, offset: int) -> str:
        self.log.flush()
        self.log.seek(offset)
        return self.log.read()[-4000:]

    def run(self, case: tuple[str, str, str], timeout: float = CASE_TIMEOUT) -> dict[str, Any]:
        if self.process is None or self.process.poll() is not None:
            self._start()
        assert self.process is not None and self.process.stdin is not None
        self.log.seek(0, 2)
        offset = self.log.tell()
        start = time.monotonic()
        try:
            self.process.stdin.write(json.dumps(case) + "\n")
            self.process.stdin.flush()
            result = self._read(timeout)
        except (BrokenPipeError, OSError, ValueError):
            result = None
        if result is not None:
            return result
        try:  # the worker closed its stdout: it is dying, not hung
            self.process.wait(max(0.0, min(10.0, timeout - (time.monotonic() - start))))
        except subprocess.TimeoutExpired:
            pass
        hung = self.process.poll() is None
        if hung:
            self.process.kill()
        code = self.process.wait()
        tail = self._log_tail(offset)
        self.process = None
        if hung:
            reason = f"hung: no result after {timeout:.0f} s"
        else:
            kind = signal.Signals(-code).name if code < 0 else f"exit code {code}"
            fatal = [line for line in tail.splitlines() if line.startswith("Fatal Python error")]
            frames = [line.strip() for line in tail.splitlines() if line.strip().startswith("File ")]
            reason = f"the worker died ({kind}){': ' + fatal[0] if fatal else ''}{' at ' + frames[0] if frames else ''}"
        return {"outcome": "crash", "reason": _short(reason, 300), "seconds": round(time.monotonic() - start, 2)}

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


class Runner:
    """Runs cases on `workers` worker processes in the background, in the order given; `result`
    waits for one case's."""

    def __init__(self, cases: Iterable[tuple[str, str, str]], workers: int = WORKERS) -> None:
        self._pending = list(cases)
        self._results: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._lock = threading.Condition()
        self._workers = [_Worker() for _ in range(max(1, min(workers, len(self._pending))))]
        self._threads = [threading.Thread(target=self._serve, args=(w,), daemon=True) for w in self._workers]
        for thread in self._threads:
            thread.start()

    def _serve(self, worker: _Worker) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                case = self._pending.pop(0)
            try:
                result = worker.run(case)
            except Exception as exc:  # noqa: BLE001 - a worker that cannot start fails its cases
                result = {"outcome": "crash", "reason": _short(f"{type(exc).__name__}: {exc}", 300)}
            with self._lock:
                self._results[case] = result
                self._lock.notify_all()

    def result(self, case: tuple[str, str, str]) -> dict[str, Any]:
        with self._lock:
            self._lock.wait_for(lambda: case in self._results)
            return self._results[case]

    def results(self) -> Iterator[tuple[tuple[str, str, str], dict[str, Any]]]:
        for thread in self._threads:
            thread.join()
        yield from self._results.items()

    def close(self) -> None:
        with self._lock:
            self._pending.clear()
        for thread in self._threads:
            thread.join()
        for worker in self._workers:
            worker.close()


# -- the tests -----------------------------------------------------------------------------------

LONG = os.environ.get("HYPOTHESIS_PROFILE", "ci") == "long"


class KnownBug(AssertionError):
    """A case still "wrong" or "crash" as `KNOWN_BUGS` lists it (the xfail it expects)."""


def _params() -> list[Any]:
    try:
        import expecttest  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        return []
    _, bugs = load_expected()
    params = []
    for case in all_cases():
        if not (LONG or in_ci(case[0]) or case in bugs):
            continue
        marks = []
        if case in bugs:
            outcome, reason = bugs[case]
            marks.append(pytest.mark.xfail(strict=True, raises=KnownBug,
                                           reason=f"KNOWN_BUGS: {outcome}: {reason} (remove it there once fixed)"))
        params.append(pytest.param(case, id=case_id(case), marks=marks))
    return params


@pytest.fixture(scope="module")
def runner(request: pytest.FixtureRequest) -> Iterator[Runner]:
    pytest.importorskip("torch", reason="the PyTorch front-end is optional")
    pytest.importorskip("expecttest", reason="PyTorch's OpInfo database needs expecttest (the test extra)")
    selected = [item.callspec.params["case"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec") and "case" in item.callspec.params]
    running = Runner(selected)
    yield running
    running.close()


def _line(case: tuple[str, str, str], outcome: str, reason: str) -> str:
    return f"    {case!r}: ({outcome!r}, {reason!r}),"


@pytest.mark.parametrize("case", _params())
def test_op_matches_cpu(case: tuple[str, str, str], runner: Runner) -> None:
    expected, bugs = load_expected()
    result = runner.result(case)
    outcome, reason = result["outcome"], result.get("reason", "")
    if outcome == "device" and not result.get("compared"):
        pytest.skip("the CPU rejects every sample (a CUDA-only op): nothing to compare")
    if case in bugs:
        listed = bugs[case][0]
        if outcome == listed:
            raise KnownBug(f"{case_id(case)} is still {outcome}: {reason}")
        if outcome in ("wrong", "crash"):
            pytest.fail(f"{case_id(case)} is now {outcome} (KNOWN_BUGS says {listed}): {reason}\n"
                        f"change its KNOWN_BUGS line to:\n{_line(case, outcome, reason)}")
        fix = f"remove its KNOWN_BUGS line\n{_line(case, *bugs[case])}"
        if outcome != "device":
            fix += f"\nand add to EXPECTED:\n{_line(case, outcome, reason)}"
        pytest.fail(f"{case_id(case)} is no longer {listed} but {outcome}: {fix}")
    listed, listed_reason = expected.get(case, ("device", ""))
    if outcome == listed:
        return
    better = OUTCOMES.index(outcome) < OUTCOMES.index(listed)
    if outcome in ("wrong", "crash"):
        fix = f"fix it, or list it in KNOWN_BUGS (never in EXPECTED):\n{_line(case, outcome, reason)}"
    elif outcome == "device":
        fix = f"remove its EXPECTED line:\n{_line(case, listed, listed_reason)}"
    else:
        fix = f"{'change its EXPECTED line to' if case in expected else 'add to EXPECTED'}:\n{_line(case, outcome, reason)}"
    verdict = "better" if better else "worse"
    pytest.fail(f"{case_id(case)} did {verdict} than listed: {outcome}, not {listed}"
                f"{': ' + reason if reason else ''}\n{fix}")


def test_expected_list_is_well_formed() -> None:
    """Every listed case is an op_db case; EXPECTED holds only fallback and refused, KNOWN_BUGS
    only wrong and crash, each with a reason, and no case is in both."""
    pytest.importorskip("torch", reason="the PyTorch front-end is optional")
    pytest.importorskip("expecttest", reason="PyTorch's OpInfo database needs expecttest (the test extra)")
    expected, bugs = load_expected()
    cases = set(all_cases())
    assert not set(expected) - cases, f"not op_db cases: {sorted(set(expected) - cases)}"
    assert not set(bugs) - cases, f"not op_db cases: {sorted(set(bugs) - cases)}"
    assert not set(expected) & set(bugs)
    assert all(o in ("fallback", "refused") and r for o, r in expected.values())
    assert all(o in ("wrong", "crash") and r for o, r in bugs.values())


# -- measuring the whole database ----------------------------------------------------------------


def measure(path: str, cases: list[tuple[str, str, str]]) -> None:
    runner = Runner(cases)
    done = 0
    out = {}
    try:
        for case in cases:
            result = runner.result(case)
            out[case_id(case)] = {"case": list(case), **result}
            done += 1
            print(f"[{done}/{len(cases)}] {case_id(case)}: {result['outcome']} {result.get('reason', '')[:120]}",
                  flush=True)
            if done % 50 == 0 or done == len(cases):
                Path(path).write_text(json.dumps(out, indent=1))
    finally:
        runner.close()


def write_expected(path: str) -> None:
    """Prints tests/data/opinfo_expected.py's two tables for a measurement."""
    results = json.loads(Path(path).read_text())
    for table, outcomes in (("EXPECTED", ("fallback", "refused")), ("KNOWN_BUGS", ("wrong", "crash"))):
        print(f"{table} = {{")
        for entry in results.values():
            if entry["outcome"] in outcomes:
                print(_line(tuple(entry["case"]), entry["outcome"], entry.get("reason", "")))
        print("}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--measure", metavar="RESULTS_JSON", help="run every case, write the results")
    parser.add_argument("--ops", help="with --measure: only these ops (comma-separated names)")
    parser.add_argument("--write-expected", metavar="RESULTS_JSON", help="print the expected tables")
    arguments = parser.parse_args()
    if arguments.worker:
        worker()
    elif arguments.measure:
        chosen = all_cases()
        if arguments.ops:
            names = set(arguments.ops.split(","))
            chosen = [c for c in chosen if c[0] in names]
        measure(arguments.measure, chosen)
    elif arguments.write_expected:
        write_expected(arguments.write_expected)
