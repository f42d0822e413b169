"""Bounds-checked reading of a flatbuffer's tables, over the `flatbuffers` package's `Table`.

A binary is untrusted input: every offset it holds is checked against the buffer before it is
followed, so a flipped byte or a truncated file is a `BinaryFormatError` naming the offset and the
field being read, never an IndexError, a struct.error, a read of unrelated bytes or a loop over a
billion-element vector. The `flatbuffers` package reads the values (its `Table` and number
types); this module only decides whether a read is inside the buffer.
"""

from __future__ import annotations

import struct
from typing import final

from flatbuffers import number_types as N
from flatbuffers.table import Table as _Table

from .._errors import BinaryFormatError

__all__ = ["Table", "size_prefixed_root"]

_U32 = struct.Struct("<I")


def size_prefixed_root(data: bytes, identifier: bytes, what: str) -> Table:
    """The root table of a size-prefixed flatbuffer with `identifier` (4 bytes after the root offset)."""
    if len(data) < 12:
        raise BinaryFormatError(f"{what} is truncated: {len(data)} bytes, a flatbuffer needs at least 12")
    (size,) = _U32.unpack_from(data, 0)
    if size != len(data) - 4:
        what_ = "truncated" if size > len(data) - 4 else "followed by stray bytes"
        raise BinaryFormatError(f"{what} is {what_}: its size prefix says {size} bytes, {len(data) - 4} follow")
    if data[8:12] != identifier:
        raise BinaryFormatError(
            f"{what} has file identifier {bytes(data[8:12])!r}, not {identifier!r}"
        )
    buf = bytearray(data[4:])
    (root,) = _U32.unpack_from(buf, 0)
    return Table.at(buf, root, what, "root table")


@final
class Table:
    """A table at a checked position; each accessor names the field it reads in its errors."""

    __slots__ = ("_t", "_vt_size", "path", "what")

    def __init__(self, t: _Table, vt_size: int, what: str, path: str) -> None:
        self._t, self._vt_size, self.what, self.path = t, vt_size, what, path

    @classmethod
    def at(cls, buf: bytearray, pos: int, what: str, path: str) -> Table:
        n = len(buf)
        if not 0 <= pos <= n - 4:
            raise BinaryFormatError(f"{what}: {path} points to offset {pos}, outside the {n}-byte buffer")
        vtable = pos - N.SOffsetTFlags.py_type(struct.unpack_from("<i", buf, pos)[0])
        if not 0 <= vtable <= n - 4:
            raise BinaryFormatError(f"{what}: {path} at offset {pos} has its vtable outside the buffer")
        vt_size, table_size = struct.unpack_from("<HH", buf, vtable)
        if vt_size < 4 or vt_size % 2 or vtable + vt_size > n or pos + table_size > n:
            raise BinaryFormatError(f"{what}: {path} at offset {pos} has a malformed vtable")
        return cls(_Table(buf, pos), vt_size, what, path)

    @property
    def pos(self) -> int:
        return int(self._t.Pos)

    def _field(self, slot: int, width: int, name: str) -> int:
        """The absolute position of the field in `slot`, or 0 when absent."""
        vt_off = 4 + 2 * slot
        if vt_off >= self._vt_size:
            return 0
        rel = self._t.Offset(vt_off)
        if not rel:
            return 0
        at = self.pos + rel
        if at + width > len(self._t.Bytes):
            raise BinaryFormatError(f"{self.what}: {self.path}.{name} at offset {at} runs past the buffer")
        return at

    def _indirect(self, at: int, name: str) -> int:
        target = at + _U32.unpack_from(self._t.Bytes, at)[0]
        if target > len(self._t.Bytes) - 4:
            raise BinaryFormatError(
                f"{self.what}: {self.path}.{name} at offset {at} points to {target}, outside the buffer"
            )
        return target

    def has(self, slot: int) -> bool:
        return self._field(slot, 1, f"field {slot}") != 0

    def scalar(self, slot: int, flags: type, default: float | bool, name: str) -> int | float | bool:
        at = self._field(slot, flags.bytewidth, name)  # type: ignore[attr-defined]
        return self._t.Get(flags, at) if at else default  # type: ignore[no-any-return]

    def string(self, slot: int, name: str) -> str | None:
        at = self._field(slot, 4, name)
        if not at:
            return None
        start = self._indirect(at, name)
        (length,) = _U32.unpack_from(self._t.Bytes, start)
        if start + 4 + length > len(self._t.Bytes):
            raise BinaryFormatError(
                f"{self.what}: {self.path}.{name} at offset {start} is {length} bytes, past the buffer"
            )
        raw = bytes(self._t.Bytes[start + 4:start + 4 + length])
        try:
            return raw.decode()
        except UnicodeDecodeError as exc:
            raise BinaryFormatError(f"{self.what}: {self.path}.{name} at offset {start} is not UTF-8: {exc}") from None

    def table(self, slot: int, name: str) -> Table | None:
        at = self._field(slot, 4, name)
        if not at:
            return None
        return Table.at(self._t.Bytes, self._indirect(at, name), self.what, f"{self.path}.{name}")

    def _vector(self, slot: int, width: int, name: str) -> tuple[int, int]:
        at = self._field(slot, 4, name)
        if not at:
            return 0, 0
        start = self._indirect(at, name)
        (length,) = _U32.unpack_from(self._t.Bytes, start)
        if start + 4 + length * width > len(self._t.Bytes):
            raise BinaryFormatError(
                f"{self.what}: {self.path}.{name} at offset {start} holds {length} elements, past the buffer"
            )
        return start + 4, length

    def tables(self, slot: int, name: str) -> list[Table]:
        start, length = self._vector(slot, 4, name)
        buf = self._t.Bytes
        return [
            Table.at(buf, start + 4 * i + _U32.unpack_from(buf, start + 4 * i)[0], self.what, f"{self.path}.{name}[{i}]")
            for i in range(length)
        ]

    def scalars(self, slot: int, fmt: str, name: str) -> list[int] | list[float]:
        """A vector of scalars of struct format `fmt` ("i", "I", "q", "f", ...)."""
        width = struct.calcsize("<" + fmt)
        start, length = self._vector(slot, width, name)
        return list(struct.unpack_from(f"<{length}{fmt}", self._t.Bytes, start)) if length else []

    def struct(self, slot: int, fmt: str, name: str) -> tuple[int | float, ...] | None:
        """An inline struct of format `fmt` (e.g. "ii" for Dim2d), or None when absent."""
        at = self._field(slot, struct.calcsize("<" + fmt), name)
        return struct.unpack_from("<" + fmt, self._t.Bytes, at) if at else None

    def bytes_of(self, slot: int, name: str) -> bytes | None:
        """A [ubyte] vector's bytes (a nested flatbuffer, e.g. the system descriptor)."""
        start, length = self._vector(slot, 1, name)
        return bytes(self._t.Bytes[start:start + length]) if start else None
