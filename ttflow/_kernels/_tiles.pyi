# Type stubs for the compiled tile kernels (see _tiles.pyx for what each does).
from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]

def tilize_into(src: Array, out: Array, nbanks: int, bank_stride: int, address: int,
                aligned: int, first: int) -> None: ...
def untilize_into(tiles: Array, out: Array, batch: int, h: int, w: int, nbanks: int,
                  bank_stride: int, address: int, aligned: int, first: int) -> None: ...
def scatter(pages: Array, banks: Array, num_pages: int, page_size: int, address: int,
            aligned: int, first: int) -> None: ...
def gather(banks: Array, out: Array, num_pages: int, page_size: int, address: int,
           aligned: int, first: int) -> None: ...
