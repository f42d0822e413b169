"""Binary: the programs of one compiled model, and the versioned file that holds them.

The binary file: a 24-byte header, `<8sIQI` = magic b"TTFLOWB\0", format version (u32), payload
length (u64), CRC32 of the payload (u32); then the payload, the programs as UTF-8 JSON. Loading
replays every program through a builder, so a file that passes the checksum but describes a
program the builder would refuse (unknown op, bad ids, shapes or dtypes that do not meet) is a
BinaryFormatError too.

Version 2 adds the ops of `docs/ops.md` past the first seventeen; a step's attrs are the
builder's canonical arguments (full-length slice bounds, non-negative axes, (height, width)
pairs), tuples written as JSON lists. Version 1 files (only the first seventeen ops) still load;
a version-1 file that names a newer op is malformed. Version 2 also stores each program's
donations (`"donations"`: [output index, input index] pairs, see `ProgramBuilder.output`).
Version 3 adds the ops of its table in `docs/ops.md` (div, log, erf, abs, full, broadcast_to,
rand, gather, embedding_grad and the convolution and pooling gradients), with no other change:
versions 1 and 2 still load, and a version-2 file that names a version-3 op is malformed. A
`full` of an infinite value writes JSON's `Infinity` (Python's json reads it back).
Version 4 adds sin, cos, floor, ceil, round and trunc, with no other change; a version-3 file
that names one of them is malformed.
Version 5 adds each program's range checks (`"range_checks"`: [value id, note] pairs, see
`ProgramBuilder.checking_range`; versions 1 to 4 still load, with none) and the ops remainder,
floor_divide, fmod, cumsum, argsort and atan2 (a version-4 file that names one of them is
malformed).
Version 6 adds bitwise_and, bitwise_or, bitwise_xor, left_shift, right_shift and prod, with no
other change; versions 1 to 5 still load, and a version-5 file that names one of them is
malformed.
Version 7 adds the collectives (all_gather, reduce_scatter, all_reduce, broadcast,
point_to_point, all_to_all) and each program's `"mesh_shape"` ([rows, cols], or null: the
mesh its collectives' shapes were resolved for, `ProgramBuilder(mesh_shape=)`); versions 1 to
6 still load (with no mesh shape), and a version-6 file that names a collective is malformed.
Version 8 adds each program's `"locations"` ([value id, location] pairs, see
`ProgramBuilder.location`), with no other change; versions 1 to 7 still load, with none.
Version 11 adds each program's `"placements"` ([value id, "dram" | "l1"] pairs, see
`ProgramBuilder.placing`), with no other change; versions 1 to 10 still load, with none.
Apart from 11, a version after 8 adds ops only: each op's record names the version that introduced it
(`OpRecord.version`; docs/ops.md has a table per version), and an older file that names it is
malformed.
`save` always writes the newest version, whatever ops the programs use: the newest of the
fields' (11) and of the ops' records (`OpRecord.version`).

`for_mesh` resolves a program's collectives for the mesh a submit runs it on: it replays the
program through a builder of that mesh shape (the loader's replay), so every later step's
shape is checked again by its op's one shape rule (its builder method; a second rule in the
record would drift from it), and keeps the result per (program, mesh shape)
(docs/architecture.md, "The op record").
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import weakref
import zlib
from collections.abc import Sequence
from typing import Any, final

import attrs
import numpy as np

from .._errors import (
    BinaryFormatError,
    FileError,
    HostOpError,
    LayoutError,
    ProgramError,
    ShapeError,
)
from .ops.host import HOST_OP
from .ops import OPS
from .program import Program, TensorSpec
from .builder import ProgramBuilder, Value
from .._types import DataType, Layout, MemorySpace, TensorLayout, check_shape

__all__ = ["Binary", "for_mesh", "get_layout"]

_MAGIC = b"TTFLOWB\0"
_FIELDS_VERSION = 11  # the newest version that changed the file's fields (placements)
_VERSION = max(_FIELDS_VERSION, *(record.version for record in OPS.values()))
"""The version `save` writes: the newest of the fields and of the ops' records (an op added to
ttflow names the version that introduced it; its record is the only place that says so)."""
_READS = tuple(range(1, _VERSION + 1))  # the versions `load` reads
_HEADER = struct.Struct("<8sIQI")  # magic, version, payload length, crc32 of payload

# Other writers' files `Binary.load` and `Binary.from_bytes` read, told apart by content: a
# size-prefixed flatbuffer's file identifier (bytes 8-12) -> the module whose `read_binary(data,
# what)` translates it (tt-mlir's `.ttnn`: `ttflow.ttnn`). A table of names, imported when such a
# file is met, because those readers are front-ends above the IR that translate into it.
_FOREIGN_FORMATS: dict[bytes, str] = {b"TTNN": "ttflow.ttnn.binary"}


def _foreign(head: bytes) -> Any:
    module = _FOREIGN_FORMATS.get(bytes(head[8:12])) if len(head) >= 12 else None
    if module is None or head.startswith(_MAGIC):
        return None
    import importlib

    return importlib.import_module(module).read_binary


@final
class Binary:
    """The programs of one compiled model, as `submit` takes them."""

    __slots__ = ("programs",)

    def __init__(self, programs: Sequence[Program]) -> None:
        if isinstance(programs, Program):
            raise ProgramError("a Binary takes a sequence of programs: tt.Binary([program])")
        programs = tuple(programs)
        if not programs or not all(isinstance(p, Program) for p in programs):
            raise ProgramError("a Binary holds a non-empty sequence of Program objects")
        self.programs: tuple[Program, ...] = programs

    def __repr__(self) -> str:
        return f"<Binary {[p.name for p in self.programs]}>"

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the versioned file (header, then the programs as JSON). A program with a host op
        (`ProgramBuilder.host_op`) cannot go to a file: HostOpError naming it, nothing written.
        A path that cannot be written (a folder, a missing folder, no permission) is a FileError
        (also an OSError) naming it."""
        payload = json.dumps(
            [_program_to_json(p) for p in self.programs], separators=(",", ":")
        ).encode()
        try:
            with open(path, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, _VERSION, len(payload), zlib.crc32(payload)) + payload)
        except OSError as exc:
            raise FileError.of(exc, "save the binary to", path, writing=True, example="model.ttb") from exc

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "the binary") -> Binary:
        """A binary from a file's bytes: ttflow's own format (what `save` writes) or a registered
        other writer's, told apart by content (tt-mlir's `.ttnn`, see `ttflow.ttnn`)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise BinaryFormatError(f"from_bytes takes bytes, got {type(data).__name__}")
        data = bytes(data)
        reader = _foreign(data[:16])
        if reader is not None:
            return reader(data, what)  # type: ignore[no-any-return]
        length = _check_header(what, data[:_HEADER.size], len(data))
        payload = data[_HEADER.size:_HEADER.size + length]
        return _from_payload(cls, what, data[:_HEADER.size], payload)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Binary:
        """Reads a file `save` wrote; BinaryFormatError for any file it did not write whole,
        FileError (also an OSError) for a path that cannot be read (missing, a folder, no
        permission).

        The header is read and checked first (magic, version, and a payload length that agrees
        with the file's size), so a foreign or truncated file is refused after reading 24 bytes;
        only then is the payload read, exactly as many bytes as the header says."""
        name = repr(os.fspath(path))
        try:
            with open(path, "rb") as f:
                header = f.read(_HEADER.size)
                reader = _foreign(header[:16])
                if reader is not None:  # another writer's format, told apart by its content
                    return reader(header + f.read(), name)  # type: ignore[no-any-return]
                length = _check_header(name, header, os.fstat(f.fileno()).st_size)
                payload = f.read(length)
        except OSError as exc:
            raise FileError.of(exc, "load a binary from", path, writing=False) from exc
        if len(payload) != length:  # the file shrank after the size check
            raise BinaryFormatError(
                f"{name} is truncated: the payload is {len(payload)} bytes, the header says {length}"
            )
        return _from_payload(cls, name, header, payload)


def _from_payload(cls: type[Binary], name: str, header: bytes, payload: bytes) -> Binary:
    """The programs of a checked header's payload."""
    _, _, _, crc = _HEADER.unpack(header)
    if zlib.crc32(payload) != crc:
        raise BinaryFormatError(f"{name} is corrupt: the payload checksum does not match")
    (version,) = struct.unpack_from("<I", header, 8)
    try:
        programs = [_program_from_json(p, version) for p in _expect(json.loads(payload), list, "payload")]
        return cls(programs)
    except BinaryFormatError as exc:
        raise BinaryFormatError(f"{name} holds a malformed program: {exc}") from None
    except (ValueError, TypeError, KeyError, IndexError, ArithmeticError, RecursionError,
            ProgramError) as exc:
        # ValueError covers JSON, Unicode, ShapeError and LayoutError from the replay;
        # ArithmeticError an integer too large for a float (a 400-digit scalar).
        raise BinaryFormatError(
            f"{name} holds a malformed program: {type(exc).__name__}: {exc}"
        ) from exc


def _check_header(name: str, header: bytes, file_size: int) -> int:
    """The payload length of a file whose first bytes are `header`; BinaryFormatError unless the
    magic and version are this ttflow's and the length agrees with the file's size."""
    if not header or not header.startswith(_MAGIC[: len(header)]):
        raise BinaryFormatError(f"{name} is not a ttflow binary (bad magic bytes)")
    if len(header) >= 12:
        (version,) = struct.unpack_from("<I", header, 8)
        if version not in _READS:
            newer = "a newer ttflow; upgrade to read it" if version > _VERSION else "an unknown writer"
            raise BinaryFormatError(
                f"{name} has format version {version}, this ttflow reads versions "
                f"{_READS[0]} to {_READS[-1]} (the file comes from {newer})"
            )
    if len(header) < _HEADER.size:
        raise BinaryFormatError(f"{name} is truncated: {len(header)} bytes, shorter than the header")
    _, _, length, _ = _HEADER.unpack(header)
    actual = file_size - _HEADER.size
    if actual != length:
        what = "truncated" if actual < length else "followed by stray bytes"
        raise BinaryFormatError(
            f"{name} is {what}: the payload is {actual} bytes, the header says {length}"
        )
    return int(length)


def _spec_to_json(s: TensorSpec) -> list[Any]:
    return [list(s.shape), s.layout.memory.name, s.layout.tensor_layout.name, s.dtype.name]


def _expect(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    """`value` if it has the JSON type `kind` (a bool is not a number here), else BinaryFormatError."""
    if not isinstance(value, kind) or isinstance(value, bool):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        names = " or ".join(k.__name__ for k in kinds)
        raise BinaryFormatError(f"{what} must be a JSON {names}, got {value!r:.60}")
    return value


def _spec_from_json(j: Any, what: str) -> TensorSpec:
    shape, memory, tensor_layout, dtype = _expect(j, list, what)
    dims = [_expect(d, int, f"{what} shape") for d in _expect(shape, list, f"{what} shape")]
    for enum_type, member in ((MemorySpace, memory), (TensorLayout, tensor_layout), (DataType, dtype)):
        if member not in enum_type.__members__:
            raise BinaryFormatError(f"{what}: {member!r:.40} is not a {enum_type.__name__}")
    return TensorSpec(
        check_shape(dims), Layout(MemorySpace[memory], TensorLayout[tensor_layout], DataType[dtype])
    )


def _program_to_json(p: Program) -> dict[str, Any]:
    if p.host_ops:
        index, label = p.host_ops[0]
        raise HostOpError(
            f"program {p.name!r} cannot be saved: step {index} is {label}, a Python function, which a "
            "binary file cannot hold; keep the Binary in memory, or lower the op to device ops", label)
    if p.consts:  # an optional key, in any version (a reader without it runs them as plain inputs)
        return {**_program_to_json(attrs.evolve(p, consts=())), "consts": list(p.consts)}
    if p.cache_constants:  # optional too: a reader without it computes them on every submit
        return {**_program_to_json(attrs.evolve(p, cache_constants=False)), "cache_constants": True}
    return {
        "name": p.name,
        "num_inputs": p.num_inputs,
        "values": [_spec_to_json(v) for v in p.values],
        "steps": [[s.op, list(s.inputs), s.scalar, [[k, v] for k, v in s.attrs], s.output] for s in p.steps],
        "outputs": list(p.outputs),
        "output_specs": [_spec_to_json(s) for s in p.output_specs],
        "donations": [list(pair) for pair in p.donations],
        "range_checks": [list(pair) for pair in p.range_checks],
        "mesh_shape": None if p.mesh_shape is None else list(p.mesh_shape),
        "locations": [list(pair) for pair in p.locations],
        "placements": [[value, memory.value] for value, memory in p.placements],
    }






def _replay(b: ProgramBuilder, op: str, args: list[Value], scalar: float | None,
            attrs_: dict[str, Any]) -> Value:
    """Calls the builder's method for one stored step, so the builder's checks run again: as
    `method(*inputs[, scalar], **attrs)`, or by the op's record (`OpRecord.replay`) where its
    inputs or attrs are not the method's arguments one for one."""
    replay = OPS[op].replay
    if replay is not None:
        result = replay(b, args, scalar, attrs_)
    else:
        method = getattr(b, op)
        result = method(*args, scalar, **attrs_) if scalar is not None else method(*args, **attrs_)
    assert isinstance(result, Value)
    return result


def _program_from_json(j: Any, version: int = _VERSION) -> Program:
    """Rebuilds a stored program through a builder and checks every value against the file."""
    j = _expect(j, dict, "a program")
    name = _expect(j["name"], str, "the program name")
    values = [_spec_from_json(v, f"value {i}") for i, v in enumerate(_expect(j["values"], list, "values"))]
    num_inputs = _expect(j["num_inputs"], int, "num_inputs")
    if not 0 <= num_inputs <= len(values):
        raise BinaryFormatError(f"num_inputs {num_inputs} does not fit {len(values)} values")
    checks: dict[int, str] = {}
    if version >= 5:
        for pair in _expect(j.get("range_checks", []), list, "range_checks"):
            value_id, note = _expect(pair, list, "a range check")
            checks[_expect(value_id, int, "a range check's value")] = _expect(note, str, "a range check's note")
    locations: dict[int, str] = {}
    if version >= 8:
        for pair in _expect(j.get("locations", []), list, "locations"):
            value_id, loc = _expect(pair, list, "a location")
            locations[_expect(value_id, int, "a location's value")] = _expect(loc, str, "a location")
    placements: dict[int, MemorySpace] = {}
    if version >= 11:
        for pair in _expect(j.get("placements", []), list, "placements"):
            value_id, memory = _expect(pair, list, "a placement")
            try:
                placements[_expect(value_id, int, "a placement's value")] = MemorySpace(memory)
            except ValueError:
                raise BinaryFormatError(f"a placement names memory {memory!r:.20}, not dram or l1") from None
    mesh_shape = None
    if version >= 7 and j.get("mesh_shape") is not None:
        mesh_shape = [_expect(d, int, "mesh_shape") for d in _expect(j["mesh_shape"], list, "mesh_shape")]
    b = ProgramBuilder(name, mesh_shape)
    consts = {_expect(i, int, "a const input") for i in _expect(j.get("consts", []), list, "consts")}
    if not consts <= set(range(num_inputs)):
        raise BinaryFormatError(f"consts {sorted(consts)!r:.40} name inputs the program does not have")
    built = [b.input(spec.shape, spec.layout, const=i in consts) for i, spec in enumerate(values[:num_inputs])]
    cache = j.get("cache_constants", False)
    if not isinstance(cache, bool):
        raise BinaryFormatError(f"cache_constants must be true or false, got {cache!r:.20}")
    if cache:
        b.cache_constants()
    for index, raw in enumerate(_expect(j["steps"], list, "steps")):
        op, inputs, scalar, step_attrs, output = _expect(raw, list, f"step {index}")
        if not isinstance(op, str) or op not in OPS:
            raise BinaryFormatError(f"step {index}: unknown op {op!r:.40}")
        if OPS[op].version > version:  # (the op's record says which version introduced it)
            raise BinaryFormatError(f"step {index}: {op} is not an op of format version {version}")
        ids = [_expect(i, int, f"step {index} input") for i in _expect(inputs, list, f"step {index} inputs")]
        if not all(0 <= i < len(built) for i in ids):
            raise BinaryFormatError(f"step {index} ({op}) reads a value that is not defined before it")
        if scalar is not None:
            scalar = float(_expect(scalar, (int, float), f"step {index} scalar"))
        pairs = [_expect(a, list, f"step {index} attrs") for a in _expect(step_attrs, list, f"step {index} attrs")]
        kwargs = {_expect(k, str, "an attr name"): tuple(v) if isinstance(v, list) else v for k, v in pairs}
        note = checks.pop(len(built), None)
        loc = locations.pop(len(built), None)
        place = placements.pop(len(built), None)
        with (b.location(loc) if loc else contextlib.nullcontext(),
              b.placing(place) if place is not None else contextlib.nullcontext()):
            if note is None:
                value = _replay(b, op, [built[i] for i in ids], scalar, kwargs)
            else:
                with b.checking_range(note):
                    value = _replay(b, op, [built[i] for i in ids], scalar, kwargs)
                if b._range_checks[-1:] != [(value.id, note)]:  # a float value, or an op that stays in range
                    raise BinaryFormatError(f"step {index} ({op}): a range check where none applies")
        if output != value.id or value.id >= len(values) or values[value.id] != b._values[value.id]:
            raise BinaryFormatError(
                f"step {index} ({op}) does not define value {output!r:.20} as the file declares it"
            )
        built.append(value)
    if len(built) != len(values):
        raise BinaryFormatError(f"{len(values)} values declared, {len(built)} defined by inputs and steps")
    if checks:
        raise BinaryFormatError(f"a range check names value {next(iter(checks))!r:.20}, which no step defines")
    if locations:
        raise BinaryFormatError(f"a location names value {next(iter(locations))!r:.20}, which no step defines")
    if placements:
        raise BinaryFormatError(f"a placement names value {next(iter(placements))!r:.20}, which no step defines")
    outputs = [_expect(i, int, "an output id") for i in _expect(j["outputs"], list, "outputs")]
    specs = [_spec_from_json(s, f"output spec {k}") for k, s in enumerate(_expect(j["output_specs"], list, "output specs"))]
    if len(specs) != len(outputs) or not all(0 <= i < len(built) for i in outputs):
        raise BinaryFormatError("the outputs do not match their specs or refer to undefined values")
    donated: dict[int, int] = {}
    if version >= 2 and "donations" in j:
        for pair in _expect(j["donations"], list, "donations"):
            k, i = (_expect(x, int, "a donation index") for x in _expect(pair, list, "a donation"))
            if not 0 <= k < len(outputs) or not 0 <= i < num_inputs or k in donated:
                raise BinaryFormatError(f"donation {pair!r:.40} names no output or input of the program")
            donated[k] = i
    for k, (value_id, spec) in enumerate(zip(outputs, specs)):
        donates = built[donated[k]] if k in donated else None
        b.output(built[value_id], spec.layout, donates=donates)
    program = b.build()
    if program.output_specs != tuple(specs):
        raise BinaryFormatError("an output spec does not match its value's shape")
    return program


_FOR_MESH: weakref.WeakKeyDictionary[Program, dict[tuple[int, int], Program]] = weakref.WeakKeyDictionary()


def for_mesh(program: Program, mesh_shape: tuple[int, int]) -> Program:
    """`program` with its collectives' shapes resolved for a `mesh_shape` mesh (a single device
    is a 1x1 mesh): the program itself when it has no collectives or was built for that shape,
    else its replay through a builder of that mesh shape, kept per (program, mesh shape) while
    the program lives. The replay checks every step again: a program whose groups do not fit
    the mesh (an all_gather's result fed to a reshape of the old size, a reduce_scatter over a
    dim the group does not divide, a sender outside the mesh) raises the builder's error here,
    before anything is queued, its message naming the program and the mesh."""
    if program.mesh_shape == mesh_shape or not program.has_collectives:
        return program
    kept = _FOR_MESH.get(program)
    if kept is None:
        kept = _FOR_MESH[program] = {}
    resolved = kept.get(mesh_shape)
    if resolved is None:
        try:
            resolved = kept[mesh_shape] = _rebuild(program, mesh_shape)
        except (ShapeError, LayoutError, ProgramError) as exc:
            rows, cols = mesh_shape
            raise type(exc)(f"program {program.name!r} does not fit a {rows}x{cols} mesh: {exc}") from None
    return resolved


def _rebuild(program: Program, mesh_shape: tuple[int, int]) -> Program:
    """`program` replayed step by step through a builder of `mesh_shape` (as `load` replays)."""
    b = ProgramBuilder(program.name, mesh_shape)
    built = [b.input(spec.shape, spec.layout, const=i in program.consts) for i, spec in enumerate(program.inputs)]
    if program.cache_constants:
        b.cache_constants()
    checks = dict(program.range_checks)
    locations = dict(program.locations)
    placements = dict(program.placements)
    host_values: list[Value] = []  # the current host op's outputs, made by its first step
    for step in program.steps:
        note, loc, place = checks.get(step.output), locations.get(step.output), placements.get(step.output)
        if step.op == HOST_OP:  # one builder call makes every output step of the op
            attrs_ = dict(step.attrs)
            host = attrs_["host"]
            if attrs_["index"] == 0:
                host_values = b.host_op(host.fn, [built[i] for i in step.inputs],
                                        [(shape, dtype) for shape, dtype in host.outputs], name=host.name)
            built.append(host_values[attrs_["index"]])
            continue
        with (b.checking_range(note) if note is not None else contextlib.nullcontext(),
              b.location(loc) if loc is not None else contextlib.nullcontext(),
              b.placing(place) if place is not None else contextlib.nullcontext()):
            built.append(_replay(b, step.op, [built[i] for i in step.inputs], step.scalar, dict(step.attrs)))
    donated = dict(program.donations)
    for k, (value, spec) in enumerate(zip(program.outputs, program.output_specs)):
        b.output(built[value], spec.layout, donates=built[donated[k]] if k in donated else None)
    return b.build()


def get_layout(binary: Binary, program_index: int, input_index: int) -> Layout:
    """The layout a program declares for one of its inputs (its dtype is always set)."""
    if not isinstance(binary, Binary):
        raise ProgramError(f"get_layout takes a tt.Binary, got {type(binary).__name__}")
    programs = binary.programs
    if not isinstance(program_index, (int, np.integer)) or not 0 <= program_index < len(programs):
        raise ProgramError(
            f"program index {program_index!r} is out of range: the binary holds "
            f"{len(programs)} programs (0..{len(programs) - 1})"
        )
    program = programs[program_index]
    inputs = program.inputs
    if not isinstance(input_index, (int, np.integer)) or not 0 <= input_index < len(inputs):
        raise ProgramError(
            f"input index {input_index!r} is out of range: {program.name!r} has {len(inputs)} inputs"
        )
    return inputs[input_index].layout
