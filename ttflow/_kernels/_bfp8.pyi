# Type stubs for the compiled BFLOAT8_B kernels (see _bfp8.pyx for what each does).
from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]

def pack_into(src: Array, out: Array, nbanks: int, bank_stride: int, address: int,
              aligned: int, first: int) -> bool: ...
def any_non_finite(src: Array) -> bool: ...
def unpack_into(packed: Array, out: Array, batch: int, h: int, w: int, nbanks: int,
                bank_stride: int, address: int, aligned: int, first: int) -> None: ...
