# cython: language_level=3
"""Tilize/untilize and interleaved page copies, on raw bytes, with the GIL released.

Everything here works on element sizes of 2 or 4 bytes; the public checks live in
`ttflow.kernels`. A tile's destination is resolved through the interleaving formula
(`_tile_ptr`), so the same loop tilizes into a flat buffer (one bank, no gaps) or straight into
bank memory (`*_to_banks`), which saves a pass over the data.
"""

from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset
from libc.stdint cimport int64_t, uint8_t

cimport numpy as cnp

cdef extern from "_stream.h" nogil:
    void ttf_copy32(char* dst, const char* src, int stream)
    void ttf_copy64(char* dst, const char* src, int stream)
    void ttf_fence(int stream)

cnp.import_array()

from ttflow._kernels._common cimport ssize, tile_ptr


cdef inline void _copy_face_row(char* dst, const char* src, ssize es, int stream) noexcept nogil:
    if es == 4:
        ttf_copy64(dst, src, stream)
    else:
        ttf_copy32(dst, src, stream)

STREAM_BYTES = 8 << 20
"""Outputs larger than this are written with streaming (non-temporal) stores."""


cdef void _tilize(const char* src, ssize batch, ssize h, ssize w,
                  ssize s_batch, ssize s_row, ssize s_col, ssize es,
                  char* out, ssize nbanks, ssize bank_stride, ssize address, ssize aligned,
                  ssize first, int stream) noexcept nogil:
    # Output order: each tile is written sequentially while its 32 source rows are read as 32
    # short streams, which the prefetchers follow; the other order scatters writes over one
    # page per tile and thrashes the TLB.
    cdef ssize th = (h + 31) // 32
    cdef ssize tw = (w + 31) // 32
    cdef ssize b, tr, r, row, tc, fc, col0, n, t, k
    cdef ssize face_row_bytes = 16 * es
    cdef const char* srow
    cdef char* tile
    cdef char* dst
    cdef bint contiguous = s_col == es
    cdef ssize f
    for b in range(batch):
        for tr in range(th):
            for tc in range(tw):
                t = (b * th + tr) * tw + tc
                tile = tile_ptr(out, t, nbanks, bank_stride, address, aligned, first)
                if contiguous and tr * 32 + 32 <= h and tc * 32 + 32 <= w:
                    # A whole tile: write it front to back, face row by face row.
                    for f in range(4):
                        srow = src + b * s_batch + (tr * 32 + (f // 2) * 16) * s_row \
                            + (tc * 32 + (f % 2) * 16) * es
                        dst = tile + f * 256 * es
                        for r in range(16):
                            _copy_face_row(dst + r * face_row_bytes, srow + r * s_row, es, stream)
                    continue
                for r in range(32):
                    row = tr * 32 + r
                    srow = src + b * s_batch + row * s_row
                    dst = tile + ((r // 16) * 512 + (r % 16) * 16) * es
                    for fc in range(2):
                        col0 = tc * 32 + fc * 16
                        if row >= h or col0 >= w:
                            memset(dst + fc * 256 * es, 0, face_row_bytes)
                            continue
                        n = w - col0
                        if n > 16:
                            n = 16
                        if contiguous:
                            memcpy(dst + fc * 256 * es, srow + col0 * es, n * es)
                        else:
                            for k in range(n):
                                memcpy(dst + (fc * 256 + k) * es, srow + (col0 + k) * s_col, es)
                        if n < 16:
                            memset(dst + (fc * 256 + n) * es, 0, (16 - n) * es)


cdef void _stream_rows(const char* src, char* dst, ssize nbytes) noexcept nogil:
    cdef ssize i = 0
    while i + 64 <= nbytes:
        ttf_copy64(dst + i, src + i, 1)
        i += 64
    if i < nbytes:
        memcpy(dst + i, src + i, nbytes - i)


cdef int _untilize_blocked(const char* tiles, ssize batch, ssize h, ssize w, ssize es, char* out,
                           ssize nbanks, ssize bank_stride, ssize address, ssize aligned,
                           ssize first) noexcept nogil:
    """Large outputs: blocks of 32 rows x 512 columns are untilized into a cache-sized scratch
    (regular stores that never leave the cache), then streamed to the output row by row
    (streaming stores, no read-for-ownership). Returns 0 if the scratch could not be allocated."""
    cdef ssize th = (h + 31) // 32
    cdef ssize tw = (w + 31) // 32
    cdef ssize block = 16  # tiles per block: 32 x 512 elements
    cdef ssize b, tr, tc0, rows, cols, ntiles, r, t, fc, col0, n, k
    cdef const char* tile
    cdef char* scratch = <char*>malloc(32 * block * 32 * es)
    cdef char* srow
    if scratch == NULL:
        return 0
    for b in range(batch):
        for tr in range(th):
            rows = h - tr * 32
            if rows > 32:
                rows = 32
            tc0 = 0
            while tc0 < tw:
                ntiles = tw - tc0
                if ntiles > block:
                    ntiles = block
                cols = w - tc0 * 32
                if cols > ntiles * 32:
                    cols = ntiles * 32
                for k in range(ntiles):
                    t = (b * th + tr) * tw + tc0 + k
                    tile = tile_ptr(<char*>tiles, t, nbanks, bank_stride, address, aligned, first)
                    for r in range(rows):
                        srow = scratch + (r * cols + k * 32) * es
                        for fc in range(2):
                            col0 = k * 32 + fc * 16
                            if col0 >= cols:
                                break
                            n = cols - col0
                            if n >= 16:
                                _copy_face_row(srow + fc * 16 * es,
                                               tile + ((r // 16) * 512 + (r % 16) * 16 + fc * 256) * es,
                                               es, 0)
                            else:
                                memcpy(srow + fc * 16 * es,
                                       tile + ((r // 16) * 512 + (r % 16) * 16 + fc * 256) * es, n * es)
                for r in range(rows):
                    _stream_rows(scratch + r * cols * es,
                                 out + ((b * h + tr * 32 + r) * w + tc0 * 32) * es, cols * es)
                tc0 += ntiles
    free(scratch)
    return 1


cdef void _untilize(const char* tiles, ssize batch, ssize h, ssize w, ssize es, char* out,
                    ssize nbanks, ssize bank_stride, ssize address, ssize aligned,
                    ssize first) noexcept nogil:
    # Tile order: each tile is read front to back and written as 32 short row streams.
    # (Measured: streaming stores do not pay here, whatever the order; see docs/performance.md.)
    cdef ssize th = (h + 31) // 32
    cdef ssize tw = (w + 31) // 32
    cdef ssize b, tr, r, row, tc, fc, col0, n, t
    cdef const char* tile
    cdef const char* srcp
    cdef char* drow
    for b in range(batch):
        for tr in range(th):
            for tc in range(tw):
                t = (b * th + tr) * tw + tc
                tile = tile_ptr(<char*>tiles, t, nbanks, bank_stride, address, aligned, first)
                for r in range(32):
                    row = tr * 32 + r
                    if row >= h:
                        break
                    drow = out + ((b * h + row) * w) * es
                    srcp = tile + ((r // 16) * 512 + (r % 16) * 16) * es
                    for fc in range(2):
                        col0 = tc * 32 + fc * 16
                        if col0 >= w:
                            break
                        n = w - col0
                        if n >= 16:
                            _copy_face_row(drow + col0 * es, srcp + fc * 256 * es, es, 0)
                        else:
                            memcpy(drow + col0 * es, srcp + fc * 256 * es, n * es)


def tilize_into(cnp.ndarray src, cnp.ndarray out, ssize nbanks, ssize bank_stride,
                ssize address, ssize aligned, ssize first):
    """src: a 3-D (batch, h, w) array of 2- or 4-byte elements, any strides. out: the bytes to fill."""
    cdef const char* sp = <const char*>cnp.PyArray_DATA(src)
    cdef char* op = <char*>cnp.PyArray_DATA(out)
    cdef ssize batch = src.shape[0], h = src.shape[1], w = src.shape[2]
    cdef ssize sb = src.strides[0], sr = src.strides[1], sc = src.strides[2]
    cdef ssize es = src.itemsize
    cdef int stream = batch * h * w * es > STREAM_BYTES
    with nogil:
        _tilize(sp, batch, h, w, sb, sr, sc, es, op, nbanks, bank_stride, address, aligned, first,
                stream)
        ttf_fence(stream)


def untilize_into(cnp.ndarray tiles, cnp.ndarray out, ssize batch, ssize h, ssize w,
                  ssize nbanks, ssize bank_stride, ssize address, ssize aligned, ssize first):
    """tiles: the bytes holding the tiles; out: a C-contiguous result of batch*h*w elements."""
    cdef const char* tp = <const char*>cnp.PyArray_DATA(tiles)
    cdef char* op = <char*>cnp.PyArray_DATA(out)
    cdef ssize es = out.itemsize
    cdef int stream = batch * h * w * es > STREAM_BYTES
    with nogil:
        if not (stream and _untilize_blocked(tp, batch, h, w, es, op, nbanks, bank_stride,
                                             address, aligned, first)):
            _untilize(tp, batch, h, w, es, op, nbanks, bank_stride, address, aligned, first)
        ttf_fence(stream)


def scatter(cnp.ndarray pages, cnp.ndarray banks, ssize num_pages, ssize page_size,
            ssize address, ssize aligned, ssize first):
    """Page j of the contiguous `pages` to page first+j of an interleaved buffer."""
    cdef const char* src = <const char*>cnp.PyArray_DATA(pages)
    cdef char* base = <char*>cnp.PyArray_DATA(banks)
    cdef ssize nbanks = banks.shape[0], stride = banks.shape[1], j
    with nogil:
        for j in range(num_pages):
            memcpy(tile_ptr(base, j, nbanks, stride, address, aligned, first),
                   src + j * page_size, page_size)


def gather(cnp.ndarray banks, cnp.ndarray out, ssize num_pages, ssize page_size,
           ssize address, ssize aligned, ssize first):
    """Pages first.. of an interleaved buffer into the contiguous `out`."""
    cdef char* dst = <char*>cnp.PyArray_DATA(out)
    cdef char* base = <char*>cnp.PyArray_DATA(banks)
    cdef ssize nbanks = banks.shape[0], stride = banks.shape[1], j
    with nogil:
        for j in range(num_pages):
            memcpy(dst + j * page_size,
                   tile_ptr(base, j, nbanks, stride, address, aligned, first), page_size)
