"""Translators from TTNN ops to ttflow builder calls, one module per family as tt-mlir's runtime
folds them (`runtime/lib/ttnn/operations/<family>/`); `TRANSLATORS` maps an MLIR op name to its
translator. An op missing here is refused at load, by name."""

from __future__ import annotations

from ..lower import Translator
from . import (
    ccl,
    control,
    conv,
    creation,
    data_movement,
    eltwise,
    layout,
    matmul,
    normalization,
    reduction,
    rows,
)

TRANSLATORS: dict[str, Translator] = {}
READS: dict[str, frozenset[str]] = {}
"""The attributes each translation reads and honours. An op with any other attribute (outside
`lower.PLACEMENT`, the compiler's plan for silicon that does not change a value) is refused at
load: an attribute a translation does not know could change the op's value."""
for _family in (ccl, control, conv, creation, data_movement, eltwise, layout, matmul, normalization, reduction, rows):
    for _name, _fn in _family.TRANSLATORS.items():
        assert _name not in TRANSLATORS, f"{_name} translated twice"
        TRANSLATORS[_name] = _fn
        READS[_name] = _family.READS[_name]

__all__ = ["READS", "TRANSLATORS"]
