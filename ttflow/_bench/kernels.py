"""Kernel bandwidth on 4096x4096 FLOAT32 and BFLOAT16, as GB/s and as a ratio to `np.copyto`.

GB/s counts the bytes of the logical host array (for BFLOAT8_B, of the float32 array) once. The
`np.copyto` baseline copies the same number of bytes between preallocated arrays and is measured
alternately with each kernel (best of `repeats` each), so a ratio compares runs that saw the same
machine. Every kernel writes into a preallocated output; all run on one thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .. import kernels


def _best_pair(baseline: Callable[[], object], fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Best times of `baseline` and `fn`, run alternately so both see the same machine."""
    baseline()
    fn()
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, f in enumerate((baseline, fn)):
            start = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def _numpy_tilize(x: np.ndarray[Any, Any], out: np.ndarray[Any, Any]) -> None:
    h, w = x.shape
    t = x.reshape(h // 32, 2, 16, w // 32, 2, 16).transpose(0, 3, 1, 4, 2, 5)
    np.copyto(out.reshape(t.shape), t)


def run(size: int = 4096, repeats: int = 5, quick: bool = False) -> dict[str, Any]:
    """Times every kernel on size x size arrays; `quick` is 512x512, best of 2 (a smoke test)."""
    if quick:
        size, repeats = 512, 2
    if size <= 0 or size % 32:
        raise ValueError(f"size must be a positive multiple of 32, got {size}")
    rows = []
    for dtype in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)):
        x = (np.random.default_rng(0).standard_normal((size, size))).astype(dtype)
        n_tiles = (size // 32) ** 2
        tiles = np.empty(x.size, dtype)
        back = np.empty_like(x)
        copy_dst = np.empty_like(x)
        nbanks = 12
        tile_bytes = 1024 * dtype.itemsize
        banks = np.zeros((nbanks, -(-n_tiles // nbanks) * tile_bytes), np.uint8)
        pages = tiles.view(np.uint8)
        gathered = np.empty_like(pages)
        cases: list[tuple[str, Callable[[], object]]] = [
            ("tilize", lambda: kernels.tilize(x, out=tiles)),
            ("untilize", lambda: kernels.untilize(tiles, x.shape, out=back)),
            ("scatter", lambda: kernels.scatter_pages(pages, banks, 0, tile_bytes, tile_bytes)),
            ("gather", lambda: kernels.gather_pages(banks, 0, tile_bytes, tile_bytes, n_tiles, out=gathered)),
            ("tilize_to_banks", lambda: kernels.tilize_to_banks(x, banks, 0, tile_bytes)),
            ("untilize_from_banks", lambda: kernels.untilize_from_banks(banks, 0, tile_bytes, x.shape, dtype, out=back)),
            ("numpy reshape/transpose tilize", lambda: _numpy_tilize(x, tiles)),
        ]
        if dtype == np.float32:
            packed = np.empty(n_tiles * 1088, np.uint8)
            bbanks = np.zeros((nbanks, -(-n_tiles // nbanks) * 1088), np.uint8)
            cases += [
                ("bfp8 pack", lambda: kernels.pack_bfloat8_b(x, out=packed)),
                ("bfp8 unpack", lambda: kernels.unpack_bfloat8_b(packed, x.shape, out=back)),
                ("bfp8 pack_to_banks", lambda: kernels.pack_bfloat8_b_to_banks(x, bbanks, 0, 1088)),
                ("bfp8 unpack_from_banks", lambda: kernels.unpack_bfloat8_b_from_banks(bbanks, 0, 1088, x.shape, out=back)),
            ]
        for name, fn in cases:
            copy, t = _best_pair(lambda: np.copyto(copy_dst, x), fn, repeats)
            rows.append({
                "kernel": name,
                "dtype": dtype.name,
                "bytes": x.nbytes,
                "gb_per_s": x.nbytes / t / 1e9,
                "copyto_gb_per_s": x.nbytes / copy / 1e9,
                "ratio_to_copyto": copy / t,
            })
    return {"benchmark": "kernels", "size": size, "repeats": repeats, "results": rows}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"kernels on {result['size']}x{result['size']} (best of {result['repeats']}, one thread)",
             f"{'kernel':<32} {'dtype':<9} {'GB/s':>7} {'copyto GB/s':>12} {'ratio':>6}"]
    for r in result["results"]:
        lines.append(f"{r['kernel']:<32} {r['dtype']:<9} {r['gb_per_s']:>7.2f} "
                     f"{r['copyto_gb_per_s']:>12.2f} {r['ratio_to_copyto']:>6.2f}")
    return "\n".join(lines)
