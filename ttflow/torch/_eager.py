"""Eager ops on tt tensors as small cached device programs (filled in by the lowering)."""

from __future__ import annotations

from typing import Any

from ._errors import UnsupportedOpError

__all__ = ["run"]


def run(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    raise UnsupportedOpError(f"{op} has no device lowering yet")
