"""`ttflow read` and `ttflow run` on a tt-mlir binary: what ttrt's `read` and `run` do, on the
emulated device.

`read` prints a binary's sections (ttrt's names: `version`, `system_desc`, `mlir`, `programs`,
`inputs`, `outputs`, `ops`): the programs with their inputs and outputs as the compiler laid them
out, every op with its location. `run` loads it, makes inputs (`--init` as ttrt's: randn, arange,
zeros, ones; or an `.npz`), runs a program `--loops` times on a device (a mesh of the binary's
mesh shape for a mesh program) and reports per program the time per loop, each output's shape,
dtype and checksum, and the peak L1 and DRAM the run held.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import BinaryFormatError
from .plan import check_plan
from .reader import TtnnFile, TtnnTensor, is_ttnn, read_ttnn
__all__ = ["SECTIONS", "INITS", "read_sections", "format_sections", "run_binary", "format_run"]

from . import INITS, SECTIONS


def _load(path: str) -> TtnnFile:
    data = Path(path).read_bytes()
    if not is_ttnn(data):
        raise BinaryFormatError(f"{path!r} is not a tt-mlir TTNN binary (no 'TTNN' file identifier)")
    return read_ttnn(data, repr(path))


def _tensor(t: TtnnTensor) -> dict[str, Any]:
    return {
        "name": t.name, "shape": list(t.shape), "data_type": t.data_type, "buffer": t.buffer,
        "layout": "tile" if t.tiled else "row_major", "memory_layout": t.memory_layout,
        "argument_type": t.argument_type, "mesh_shape": list(t.mesh_shape), "local_shape": list(t.local_shape),
    }


def read_sections(path: str, sections: Sequence[str] = ()) -> dict[str, Any]:
    """The binary's sections as plain data (all of them when `sections` is empty)."""
    file = _load(path)
    wanted = set(sections or SECTIONS)
    out: dict[str, Any] = {}
    if "version" in wanted:
        out["version"] = {"schema_hash": file.schema.hash, "producer": file.schema.producer,
                          "ttmlir_git_hash": file.git_hash}
    if "system_desc" in wanted:
        out["system_desc"] = _system_desc(file)
    if "mlir" in wanted:
        out["mlir"] = file.mlir
    for key in ("programs", "inputs", "outputs", "ops"):
        if key not in wanted:
            continue
        out[key] = []
        for i, p in enumerate(file.programs):
            entry: dict[str, Any] = {"program_index": i, "name": p.name}
            if key == "programs":
                plan = check_plan(file, p)
                entry.update(private=p.private, inputs=len(p.inputs), outputs=len(p.outputs), ops=len(p.ops),
                             mesh_shape=list(p.mesh_shape) if p.mesh_shape else None,
                             compiled_peak_l1_bytes_per_core=plan.peak_l1_per_core,
                             compiled_peak_dram_bytes_per_bank=plan.peak_dram_per_bank)
            elif key in ("inputs", "outputs"):
                entry[key] = [_tensor(t) for t in getattr(p, key)]
            else:
                entry["ops"] = [{"index": op.index, "name": op.name, "location": op.location,
                                 "results": list(op.op.results), "operands": list(op.op.operands)}
                                for op in p.ops]
            out[key].append(entry)
    return out


def _system_desc(file: TtnnFile) -> dict[str, Any]:
    """What the binary says about the system it was compiled for (the module's #system_desc)."""
    import re

    m = re.search(r"#system_desc = (#ttcore\.system_desc<.*)", file.mlir)
    text = m[1] if m else ""
    found = {key: re.findall(rf"\b{key} = (\d+)", text)[:1] for key in
             ("l1_size", "num_dram_channels", "dram_channel_size", "l1_unreserved_base")}
    grid = re.search(r"grid = (\d+x\d+)", text)
    return {"grid": grid[1] if grid else None, **{k: int(v[0]) for k, v in found.items() if v},
            "chips": text.count("arch = <")}


def format_sections(data: dict[str, Any]) -> str:
    lines = []
    for key, value in data.items():
        lines.append(f"== {key}")
        if key == "mlir":
            lines.append(value)
        elif isinstance(value, list):
            for entry in value:
                head = f"[{entry['program_index']}] {entry['name']}"
                if key == "programs":
                    lines.append(f"{head}: {entry['inputs']} inputs, {entry['outputs']} outputs, {entry['ops']} ops"
                                 f"{' (private)' if entry['private'] else ''}"
                                 f"{'' if not entry['mesh_shape'] else ' on a ' + 'x'.join(map(str, entry['mesh_shape'])) + ' mesh'}"
                                 f"; as compiled, peak L1 {entry['compiled_peak_l1_bytes_per_core']} B per core, "
                                 f"DRAM {entry['compiled_peak_dram_bytes_per_bank']} B per bank")
                elif key in ("inputs", "outputs"):
                    lines.append(head)
                    for j, t in enumerate(entry[key]):
                        lines.append(f"  {j}: {'x'.join(map(str, t['shape'])) or 'scalar'} {t['data_type']} "
                                     f"{t['buffer']} {t['layout']} {t['memory_layout']}"
                                     f"{' ' + t['argument_type'] if key == 'inputs' else ''}"
                                     f"{' ' + repr(t['name']) if t['name'] else ''}")
                else:
                    lines.append(head)
                    for op in entry["ops"]:
                        lines.append(f"  {op['index']:4d} {op['name']:<24} {op['location']}")
        else:
            lines.extend(f"  {k}: {v}" for k, v in value.items())
    return "\n".join(lines)


def _inputs(tensors: Sequence[TtnnTensor], init: str, seed: int, given: dict[str, np.ndarray],
            chips: int) -> list[list[np.ndarray]]:
    """Per input, one array per chip: from `given` (`in{j}`, or `in{j}_chip{c}` per chip) or made
    by `init`."""
    rng = np.random.default_rng(seed)
    out = []
    for j, t in enumerate(tensors):
        shape = t.shape or (1,)
        dtype = np.int32 if t.data_type in ("si32", "ui32", "ui16", "ui8") else np.float32
        per_chip = []
        for c in range(chips):
            key = f"in{j}_chip{c}" if f"in{j}_chip{c}" in given else f"in{j}"
            if key in given:
                array = np.asarray(given[key])
                per_chip.append(array.reshape(array.shape or (1,)))
                continue
            if init == "randn":
                array = rng.standard_normal(shape)
                array = np.clip(np.round(array * 4), -8, 8) if dtype == np.int32 else array
            elif init == "arange":
                array = np.arange(int(np.prod(shape))).reshape(shape) % 251
            else:
                array = np.full(shape, 0 if init == "zeros" else 1)
            per_chip.append(np.asarray(array, dtype))
        out.append(per_chip)
    return out


async def run_binary(path: str, *, program_index: int | None = None, loops: int = 1, init: str = "randn",
                     seed: int = 0, inputs: str | None = None, save_outputs: str | None = None,
                     trace: str | None = None) -> dict[str, Any]:
    """Runs the binary's public programs (or `program_index`) and reports each."""
    import ttflow as tt

    file = _load(path)
    binary = tt.Binary.load(path)
    given = dict(np.load(inputs)) if inputs else {}
    indices = [program_index] if program_index is not None else \
        [i for i, p in enumerate(file.programs) if not p.private]
    results = []
    saved: dict[str, np.ndarray] = {}
    for i in indices:
        program = file.programs[i]
        mesh_shape = program.mesh_shape or (1, 1)
        chips = mesh_shape[0] * mesh_shape[1]
        arrays = _inputs(program.inputs, init, seed, given, chips)
        spec = None if chips == 1 else tt.MeshSpec(mesh_shape)
        opener = tt.open_device() if spec is None else tt.open_mesh_device(spec)
        device: Any
        async with opener as device:
            def place(j: int, per_chip: list[np.ndarray]) -> Any:
                layout = tt.get_layout(binary, i, j)
                if spec is None:
                    return tt.to_device(per_chip[0], device, layout)
                return tt.from_shards(per_chip, device, layout)

            times = []
            recorder = tt.record_timeline(device) if trace else None
            with recorder if recorder is not None else contextlib.nullcontext() as timeline:
                for _ in range(loops):
                    tensors = [place(j, a) for j, a in enumerate(arrays)]
                    start = time.perf_counter()
                    outs = tt.submit(device, binary, i, tensors)
                    for out in outs:
                        await tt.wait(out)
                    times.append(time.perf_counter() - start)
            if timeline is not None and trace:
                timeline.save(trace)
            outputs = []
            for k, (out, t) in enumerate(zip(outs, program.outputs, strict=True)):
                pieces = [await tt.to_host(p) for p in tt.device_tensors(out)]
                shape = tuple(t.shape)
                pieces = [p.reshape(shape) if p.size == int(np.prod(shape)) else p for p in pieces]
                digest = hashlib.sha256(b"".join(np.ascontiguousarray(p).tobytes() for p in pieces)).hexdigest()[:16]
                outputs.append({"shape": list(shape), "dtype": str(pieces[0].dtype), "chips": len(pieces),
                                "sha256": digest, "sum": float(sum(np.sum(p, dtype=np.float64) for p in pieces))})
                for c, p in enumerate(pieces):
                    saved[f"program{i}_out{k}" + (f"_chip{c}" if len(pieces) > 1 else "")] = p
            chip_list: list[Any] = [device] if spec is None else device.chips
            stats = [chip.stats for chip in chip_list]
            l1 = max(s.l1_peak_bytes for s in stats)
            plan = check_plan(file, program)
            results.append({
                "program_index": i, "name": program.name, "loops": loops,
                "compiled_peak_l1_bytes_per_core": plan.peak_l1_per_core,
                "compiled_peak_dram_bytes_per_bank": plan.peak_dram_per_bank,
                "seconds_per_loop": sorted(times)[len(times) // 2],
                "outputs": outputs,
                "peak_l1_bytes": l1,
                "peak_l1_bytes_per_core": l1 // _cores(chip_list[0]),
                "peak_dram_bytes": max(s.dram_peak_bytes for s in stats),
                "const_eval": {"hits": sum(s.const_eval_hits for s in stats),
                               "misses": sum(s.const_eval_misses for s in stats)},
            })
    if save_outputs:
        np.savez(save_outputs, **saved)  # type: ignore[arg-type]  # numpy's stub types **kwds as bool
    return {"binary": path, "programs": results}


def _cores(device: Any) -> int:
    grid = device.spec.worker_grid
    return int(grid[0] * grid[1])


def format_run(report: dict[str, Any], memory: bool) -> str:
    lines = [f"{report['binary']}"]
    for p in report["programs"]:
        lines.append(f"[{p['program_index']}] {p['name']}: {p['seconds_per_loop'] * 1e3:.3f} ms per loop "
                     f"(median of {p['loops']})")
        for k, o in enumerate(p["outputs"]):
            lines.append(f"  out {k}: {'x'.join(map(str, o['shape'])) or 'scalar'} {o['dtype']}"
                         f"{'' if o['chips'] == 1 else ' on ' + str(o['chips']) + ' chips'}"
                         f" sha256 {o['sha256']} sum {o['sum']:.6g}")
        if memory:
            lines.append(f"  as compiled: peak L1 {p['compiled_peak_l1_bytes_per_core']} bytes per core, "
                         f"peak DRAM {p['compiled_peak_dram_bytes_per_bank']} bytes per bank (the compiler's plan)")
            lines.append(f"  as run: peak L1 {p['peak_l1_bytes']} bytes ({p['peak_l1_bytes_per_core']} per core), "
                         f"peak DRAM {p['peak_dram_bytes']} bytes (ttflow's scheduler's placement)")
    return "\n".join(lines)


def dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2)
