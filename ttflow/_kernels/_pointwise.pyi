from typing import Any

import numpy as np

OP_ADD: int
OP_SUB: int
OP_MUL: int
OP_RELU: int
OP_NEG: int
OP_COPY: int
MAX_OPERANDS: int

def run(
    banks: np.ndarray[Any, Any],
    code: tuple[tuple[int, int, int, float, int], ...],
    addresses: tuple[int, ...],
    rows: int,
    depth: int,
) -> None: ...
