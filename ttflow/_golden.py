"""Golden comparison: every op of a program run on the device against the same op in float64.

`ttrt run` compares each op with a golden, and Tenstorrent's Chisel swaps golden values in for
device outputs to isolate the first divergence. `tt.compare_with_golden` does both with debug
hooks (`_debug`): it runs the program once on the device and, after each op, reads what the op
read and what it wrote, and computes the op on the host in float64:

- the *local* golden, from the very inputs the op read: the op's own error, judged against the
  rounding its dtype allows (`bound`). This decides `ok`, so an op is flagged for what it
  did, never for what it was given.
- the *chain* golden, from the program's inputs through float64 ops all the way: how far the
  run has drifted by then (`pcc`, `max_abs`, `max_rel`; with `substitute=True` these are the
  local figures, since the run stays on the golden path).

With `substitute=True` (Chisel's isolation mode) each op's output is replaced by its golden
(rounded to the op's dtype) before the next op reads it, so that data-dependent steps (an
argmax, a gather by computed indices) see what a correct run would have given them.

The bound an op's error is held to, element by element: u(dtype) |golden| (the output's
rounding: 2**-24 FLOAT32, 2**-8 BFLOAT16; BFLOAT8_B 2**-6 of the largest |golden|, its shared
exponents) plus 4 K 2**-24 m for the float32 arithmetic before it, where K is how many terms
the op accumulates (a matmul's inner dimension, a reduction's axis, a convolution's C kh kw,
a pool's window) and m the magnitude of those terms (the op applied to |inputs| for sums and
products, the largest |golden| for the others). Integer results are exact (bound 0).
"""

from __future__ import annotations

import inspect
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, final

import attrs
import numpy as np

from ._ir.binary import Binary
from ._observe.debug import OpContext, debug_hooks
from ._runtime.const_eval import split_of
from ._runtime.device import Device
from ._errors import FileError, ProgramError
from ._mesh import api
from ._ir.ops import OPS
from ._ir.program import Program, Step
from ._types import DataType

__all__ = ["GoldenReport", "GoldenRow", "compare_with_golden"]

Array = np.ndarray[Any, Any]

_UNIT_ROUNDOFF = {DataType.FLOAT32: 2.0**-24, DataType.BFLOAT16: 2.0**-8}
_BFLOAT8_B_ROUNDOFF = 2.0**-6  # of the largest |golden|: 7-bit magnitudes under a shared exponent
_BFLOAT16_MAX = 3.3895313892515355e38  # bfloat16's (and BFLOAT8_B's exponents') largest finite value
_COMPUTE_ULPS = 4.0  # float32 arithmetic: numpy's transcendental functions within a few ulp


@final
@attrs.frozen
class GoldenRow:
    """One op of the run: `index`, `name`, `loc`, `dtype` (its output's), the error against the
    golden (`pcc`, `max_abs`, `max_rel`: the chain golden's, or the local one's when
    substituting), `local_max_abs` (against the golden from the inputs it read), `bound` (the
    largest error its dtype allows, element by element; this is its largest element), and `ok`
    (every element's local error within its bound). `golden_precision` is "float64", or
    "float32" for an op whose host function computes in float32 only."""

    index: int
    name: str
    loc: str | None
    dtype: str
    pcc: float
    max_abs: float
    max_rel: float
    local_max_abs: float
    bound: float
    ok: bool
    golden_precision: str = "float64"


@final
@attrs.frozen
class GoldenReport:
    """`ops`, one `GoldenRow` per op in program order; `outputs`, the program's outputs as read
    after the run (host arrays); `substitute`, the mode."""

    program: str
    substitute: bool
    ops: tuple[GoldenRow, ...]
    outputs: tuple[Array, ...] = attrs.field(eq=False, repr=False)

    @property
    def first_failure(self) -> GoldenRow | None:
        """The first op whose own error exceeds its bound, or None."""
        return next((row for row in self.ops if not row.ok), None)

    @property
    def ok(self) -> bool:
        return self.first_failure is None

    def table(self) -> str:
        """A plain-text table, one line per op, the first failure marked."""
        first = self.first_failure
        lines = [f"golden comparison of {self.program!r} ({'substituting' if self.substitute else 'chain'})",
                 f"{'#':>4} {'op':<14} {'dtype':<10} {'pcc':>10} {'max_abs':>10} {'max_rel':>10} "
                 f"{'local_abs':>10} {'bound':>10} {'ok':>3}  loc"]
        for row in self.ops:
            mark = "  <- first failure" if row is first else ""
            lines.append(f"{row.index:>4} {row.name:<14} {row.dtype:<10} {row.pcc:>10.6f} {row.max_abs:>10.3e} "
                         f"{row.max_rel:>10.3e} {row.local_max_abs:>10.3e} {row.bound:>10.3e} "
                         f"{'yes' if row.ok else 'NO':>3}  {row.loc or ''}{mark}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"program": self.program, "substitute": self.substitute,
                           "first_failure": None if self.first_failure is None else self.first_failure.index,
                           "ops": [_finite(attrs.asdict(row)) for row in self.ops]}, indent=1)

    def plot(self, path: str) -> None:
        """A PNG of each op's error and bound (log scale), failures in red (the `plot` extra)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:  # pragma: no cover - the plot extra
            raise ImportError("GoldenReport.plot needs matplotlib: pip install '.[plot]' from the ttflow checkout") from exc
        index = [row.index for row in self.ops]
        fig, ax = plt.subplots(figsize=(max(6.0, len(index) * 0.3), 4))
        ax.semilogy(index, [max(row.local_max_abs, 1e-30) for row in self.ops], "o-", label="own error")
        ax.semilogy(index, [max(row.bound, 1e-30) for row in self.ops], "k--", label="bound")
        ax.semilogy(index, [max(row.max_abs, 1e-30) for row in self.ops], "x:", label="drift from golden")
        bad = [row for row in self.ops if not row.ok]
        ax.semilogy([r.index for r in bad], [max(r.local_max_abs, 1e-30) for r in bad], "ro", label="over bound")
        ax.set_xlabel("op")
        ax.set_ylabel("max |error|")
        ax.set_title(self.program)
        ax.legend()
        fig.tight_layout()
        try:
            fig.savefig(path)
        except OSError as exc:
            raise FileError.of(exc, "write the plot to", path, writing=True, example="golden.png") from exc
        finally:
            plt.close(fig)


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}












def _host(array: Array) -> Array:
    """A device value as the golden computes on it: float64, or int64."""
    if array.dtype.kind in "iub":
        return array.astype(np.int64)
    return np.asarray(array, np.float64)


def golden_op(step: Step, operands: list[Array], out_dtype: DataType) -> tuple[Array, str]:
    """`step` on the host in float64 (int64 for integer results): the result, and "float64",
    or "float32" when the op's host function computes only in float32."""
    attrs_ = dict(step.attrs)
    fn = OPS[step.op].float64 if out_dtype.is_float else None
    with np.errstate(all="ignore"):
        result = np.asarray((fn or OPS[step.op].fn)(operands, step.scalar, **attrs_))
    precision = "float64"
    if out_dtype.is_float:
        if result.dtype != np.float64 and any(o.dtype == np.float64 for o in operands):
            precision = "float32"
        result = result.astype(np.float64)
    return result, precision


def _accumulated_terms(step: Step, shapes: list[tuple[int, ...]]) -> int:
    """How many terms the op adds into one result (K of the bound: its record's rule)."""
    accumulates = OPS[step.op].accumulates
    return accumulates(dict(step.attrs), shapes) if accumulates is not None else 1


def _bound(step: Step, golden: Array, operands: list[Array], dtype: DataType) -> Array:
    """Each element's largest error the op's dtype and float32 arithmetic allow (see above)."""
    if not dtype.is_float:
        return np.zeros(golden.shape)
    g = np.abs(golden)
    # the largest finite |golden|: a NaN or an infinity elsewhere (a log of a negative, an
    # overflow) must not make every element's bound NaN
    top = float(np.max(g[np.isfinite(g)], initial=0.0))
    if dtype is DataType.BFLOAT8_B:
        rounding = np.full(golden.shape, _BFLOAT8_B_ROUNDOFF * top)
    else:
        rounding = _UNIT_ROUNDOFF[dtype] * g
    terms = _accumulated_terms(step, [o.shape for o in operands])
    if OPS[step.op].magnitude_bound:
        magnitude, _ = golden_op(step, [np.abs(o) if o.dtype.kind == "f" else o for o in operands], dtype)
        magnitude = np.abs(np.broadcast_to(magnitude, golden.shape))
    else:
        magnitude = np.full(golden.shape, top)
    return rounding + _COMPUTE_ULPS * terms * 2.0**-24 * magnitude


def _pcc(a: Array, b: Array) -> float:
    x, y = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    if x.size == 0 or np.array_equal(x, y):
        return 1.0
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        return float("nan")
    sx, sy = x.std(), y.std()
    if sx == 0 or sy == 0:
        return 1.0 if np.allclose(x, y) else 0.0
    return float(np.mean((x - x.mean()) * (y - y.mean())) / (sx * sy))


def _errors(device: Array, golden: Array) -> tuple[float, float]:
    if device.size == 0:
        return 0.0, 0.0
    diff = np.abs(device - golden)
    with np.errstate(all="ignore"):
        rel = np.where(golden != 0, diff / np.abs(golden), np.where(diff == 0, 0.0, np.inf))
    return float(np.nanmax(diff)), float(np.nanmax(rel))


# -- the run ------------------------------------------------------------------------------------


async def compare_with_golden(device: Device, binary: Binary, program_index: int, inputs: Sequence[Any],
                              substitute: bool = False,
                              post_op: Callable[[OpContext], Any] | None = None) -> GoldenReport:
    """Runs the program once on `device` with every op compared against float64 on the host
    (see the module's docstring); returns the report. `post_op` (sync or async) runs inside,
    after each op and before its comparison: a test perturbs a value there to see it named.
    The program's outputs are read into the report and freed."""
    if not isinstance(binary, Binary):
        raise ProgramError(f"expected a tt.Binary, got {type(binary).__name__}")
    if not 0 <= program_index < len(binary.programs):
        raise ProgramError(f"program index {program_index} is out of range: the binary has "
                           f"{len(binary.programs)} programs")
    program: Program = binary.programs[program_index]
    if len(inputs) != program.num_inputs:
        raise ProgramError(f"program {program.name!r} takes {program.num_inputs} inputs, {len(inputs)} were given")
    chain: dict[int, Array] = {}
    for index, tensor in enumerate(inputs):
        chain[index] = _host(await api.to_host(tensor))
    split = split_of(program)
    if split is not None:  # the part that runs numbers its values anew: its inputs first
        chain = {k: chain[i] for k, i in enumerate(split.main_inputs)}
    rows: list[GoldenRow] = []
    read_before: dict[int, list[Array]] = {}

    # A program with constant parts runs them apart first (`main.const_eval`, cached): their ops
    # are not this program's, and what they computed is taken as the device gave it.
    async def before(ctx: OpContext) -> None:  # what the op reads, before it runs (an in-place cache changes it)
        if ctx.program.name == program.name:
            read_before[ctx.index] = [_host(await api.to_host(h)) for h in ctx.inputs]

    async def after(ctx: OpContext) -> None:
        if ctx.program.name != program.name:
            return
        if post_op is not None:
            result = post_op(ctx)
            if inspect.isawaitable(result):
                await result
        step = ctx.program.steps[ctx.index]
        locations = dict(ctx.program.locations)
        out = ctx.outputs[0]
        dtype = out.dtype
        device_value = _host(await api.to_host(out))
        operands = read_before.pop(ctx.index)
        if step.op not in OPS:  # a host op: the host's own function, nothing to compare with
            chain[step.output] = device_value
            rows.append(GoldenRow(ctx.index, ctx.name, locations.get(step.output), dtype.name, 1.0, 0.0, 0.0,
                                  0.0, 0.0, True, "host"))
            return
        local, precision = golden_op(step, operands, dtype)
        local = np.broadcast_to(local, device_value.shape)
        if dtype.is_float:  # beyond the dtype's largest finite value, its rounding is an infinity
            largest = float(np.finfo(np.float32).max) if dtype is DataType.FLOAT32 else _BFLOAT16_MAX
            local = np.where(np.abs(local) > largest, np.copysign(np.inf, local), local)
        bound = _bound(step, local, operands, dtype)
        local_error = np.abs(device_value - local)
        ok = bool(np.all(local_error <= bound)) if device_value.size else True
        if not np.all(np.isfinite(local)) or not np.all(np.isfinite(device_value)):
            same = (np.isnan(local) == np.isnan(device_value)) & ((local == device_value) | np.isnan(local)
                                                                  | (local_error <= bound))
            ok = bool(np.all(same))
        if substitute:
            reference = local
            chain[step.output] = local
            await _substitute(out, local, dtype)
        else:
            reference, _ = golden_op(step, [chain.get(v, given) for v, given in zip(step.inputs, operands, strict=True)],
                                     dtype)
            reference = np.broadcast_to(reference, device_value.shape)
            chain[step.output] = reference
        max_abs, max_rel = _errors(device_value, reference)
        local_abs, _ = _errors(device_value, local)
        rows.append(GoldenRow(ctx.index, step.op, locations.get(step.output), dtype.name,
                              _pcc(device_value, reference), max_abs, max_rel, local_abs,
                              float(np.max(bound[np.isfinite(bound)], initial=0.0)), ok, precision))

    with debug_hooks(device, pre_op=before, post_op=after):
        outputs = api.submit(device, binary, program_index, list(inputs))
        try:
            arrays = tuple([await api.to_host(t) for t in outputs])
        finally:
            for t in outputs:
                api.deallocate(t)
    return GoldenReport(program.name, substitute, tuple(rows), arrays)


async def _substitute(handle: Any, golden: Array, dtype: DataType) -> None:
    """The golden, in the handle's host dtype, written over the device's value."""
    host = dtype.host_dtype
    if dtype.is_float:
        api.write(handle, golden.astype(np.float32).astype(host))
    else:
        info = np.iinfo(host)
        api.write(handle, np.clip(golden, info.min, info.max).astype(host))


# -- `ttflow golden FILE.ttb` -------------------------------------------------------------------------


def random_inputs(program: Program, seed: int) -> list[Array]:
    """Seeded host arrays for a program's inputs: standard normal floats, integers in [-100, 100)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for spec in program.inputs:
        dtype = spec.layout.dtype
        assert dtype is not None
        if dtype.is_float:
            arrays.append(rng.standard_normal(spec.shape).astype(np.float32))
        else:
            low = 0 if dtype is DataType.UINT32 else -100
            arrays.append(rng.integers(low, 100, spec.shape).astype(dtype.host_dtype))
    return arrays


def run_file(path: str, program_index: int = 0, substitute: bool = False, seed: int = 0,
             as_json: bool = False, plot: str | None = None, small: bool = False) -> int:
    """`ttflow golden`: the report of one program of a binary file on seeded random inputs,
    printed; 1 when an op exceeds its bound (or the file cannot be run), else 0."""
    import anyio

    from ._runtime.device import open_device
    from ._errors import TTFlowError
    from ._types import DeviceSpec

    try:
        binary = Binary.load(path)
    except (OSError, TTFlowError) as exc:
        print(f"ttflow golden: {exc}", file=sys.stderr)
        return 1
    if not 0 <= program_index < len(binary.programs):
        print(f"ttflow golden: --program {program_index} is out of range: {path} holds "
              f"{len(binary.programs)} programs", file=sys.stderr)
        return 1
    program = binary.programs[program_index]

    async def main() -> GoldenReport:
        async with open_device(DeviceSpec.small() if small else DeviceSpec()) as device:
            inputs = [api.to_device(array, device, spec.layout)
                      for array, spec in zip(random_inputs(program, seed), program.inputs)]
            return await compare_with_golden(device, binary, program_index, inputs, substitute=substitute)

    try:
        report = anyio.run(main)
    except TTFlowError as exc:
        print(f"ttflow golden: {program.name!r} failed on the device: {exc}", file=sys.stderr)
        return 1
    print(report.to_json() if as_json else report.table())
    if plot is not None:
        report.plot(plot)
    return 0 if report.ok else 1
