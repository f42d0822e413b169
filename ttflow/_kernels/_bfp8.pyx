# cython: language_level=3
"""BFLOAT8_B pack and unpack, a face row at a time, with the GIL released.

Each 16-value face row is read straight from its source row (or from a zero-padded copy at the
array's edges, or for strided inputs) and packed by `ttf_bfp8_pack_row` (`_bfp8.h`) as tt-metal's
host packer does: its shared exponent is the largest biased exponent of its values; each value's
24-bit significand is shifted right by (shared - own exponent), dropping the bits shifted out,
then rounded to 7 bits at bit 17, to nearest with ties to even, and clamped to 127. A zero
magnitude packs as 0x00 whatever the sign; zeros and subnormals pack as 0x00. NaN and infinity
have no encoding: the pack reports them (a shared exponent of 255) and the caller raises.

A tile is written front to back (64 exponent bytes, then 1024 mantissa bytes), so the same loop
packs into a flat buffer or straight into interleaved bank pages (`_tile_ptr`).
"""

from libc.string cimport memcpy, memset
from libc.stdint cimport uint8_t, intptr_t

cimport numpy as cnp

from ttflow._kernels._common cimport RELEASE_BYTES

cdef extern from "_bfp8.h" nogil:
    unsigned ttf_bfp8_pack_row(const float* src, uint8_t* mant)
    void ttf_bfp8_unpack_row(unsigned shared, const uint8_t* mant, float* dst)
    int ttf_any_non_finite(const float* src, intptr_t n)

cnp.import_array()

ctypedef Py_ssize_t ssize


cdef inline char* _tile_ptr(char* base, ssize t, ssize nbanks, ssize bank_stride,
                            ssize address, ssize aligned, ssize first) noexcept nogil:
    cdef ssize page = first + t
    return base + (page % nbanks) * bank_stride + address + (page // nbanks) * aligned


cdef inline const float* _face_row(const char* src, ssize h, ssize w, ssize s_row, ssize s_col,
                                   ssize row, ssize col0, float* tmp) noexcept nogil:
    """The 16 values of one face row: a pointer into the source when they are all there and
    contiguous, else `tmp` filled with them and zero padding."""
    cdef ssize n, k
    if row < h and col0 + 16 <= w and s_col == 4:
        return <const float*>(src + row * s_row + col0 * 4)
    memset(tmp, 0, 64)
    if row < h and col0 < w:
        n = w - col0
        if n > 16:
            n = 16
        for k in range(n):
            memcpy(tmp + k, src + row * s_row + (col0 + k) * s_col, 4)
    return tmp


cdef int _pack(const char* src, ssize batch, ssize h, ssize w, ssize s_batch, ssize s_row,
               ssize s_col, char* out, ssize nbanks, ssize bank_stride, ssize address,
               ssize aligned, ssize first) noexcept nogil:
    cdef ssize th = (h + 31) // 32, tw = (w + 31) // 32
    cdef ssize b, tr, tc, t, f, r, k
    cdef float tmp[16]
    cdef const char* slice_
    cdef uint8_t* tile
    cdef unsigned e
    cdef int bad = 0
    for b in range(batch):
        slice_ = src + b * s_batch
        for tr in range(th):
            for tc in range(tw):
                t = (b * th + tr) * tw + tc
                tile = <uint8_t*>_tile_ptr(out, t, nbanks, bank_stride, address, aligned, first)
                for f in range(4):
                    for r in range(16):
                        k = f * 16 + r
                        e = ttf_bfp8_pack_row(
                            _face_row(slice_, h, w, s_row, s_col, tr * 32 + (f >> 1) * 16 + r,
                                      tc * 32 + (f & 1) * 16, tmp),
                            tile + 64 + k * 16)
                        tile[k] = <uint8_t>e
                        bad |= e == 255
    return bad


cdef void _unpack(const char* packed, ssize batch, ssize h, ssize w, char* out, ssize nbanks,
                  ssize bank_stride, ssize address, ssize aligned, ssize first) noexcept nogil:
    cdef ssize th = (h + 31) // 32, tw = (w + 31) // 32
    cdef ssize b, tr, tc, t, f, r, k, row, col0
    cdef float tmp[16]
    cdef const uint8_t* tile
    cdef float* dst
    for b in range(batch):
        for tr in range(th):
            for tc in range(tw):
                t = (b * th + tr) * tw + tc
                tile = <const uint8_t*>_tile_ptr(<char*>packed, t, nbanks, bank_stride, address,
                                                 aligned, first)
                for f in range(4):
                    col0 = tc * 32 + (f & 1) * 16
                    if col0 >= w:
                        continue
                    for r in range(16):
                        row = tr * 32 + (f >> 1) * 16 + r
                        if row >= h:
                            break
                        k = f * 16 + r
                        dst = <float*>(out + ((b * h + row) * w + col0) * 4)
                        if col0 + 16 <= w:
                            ttf_bfp8_unpack_row(tile[k], tile + 64 + k * 16, dst)
                        else:
                            ttf_bfp8_unpack_row(tile[k], tile + 64 + k * 16, tmp)
                            memcpy(dst, tmp, (w - col0) * 4)


def pack_into(cnp.ndarray src, cnp.ndarray out, ssize nbanks, ssize bank_stride, ssize address,
              ssize aligned, ssize first):
    """src: a 3-D float32 array (any strides). Returns True if it held a NaN or infinity.

    On True the output is partly written; callers that must not leave a half-written
    destination call `any_non_finite` first."""
    cdef const char* sp = <const char*>cnp.PyArray_DATA(src)
    cdef char* op = <char*>cnp.PyArray_DATA(out)
    cdef ssize batch = src.shape[0], h = src.shape[1], w = src.shape[2]
    cdef ssize sb = src.strides[0], sr = src.strides[1], sc = src.strides[2]
    cdef int bad
    if batch * h * w * 4 >= RELEASE_BYTES:
        with nogil:
            bad = _pack(sp, batch, h, w, sb, sr, sc, op, nbanks, bank_stride, address, aligned, first)
    else:
        bad = _pack(sp, batch, h, w, sb, sr, sc, op, nbanks, bank_stride, address, aligned, first)
    return bool(bad)


def any_non_finite(cnp.ndarray src):
    """True if the float32 array holds a NaN or an infinity (a read-only scan, GIL released)."""
    cdef cnp.ndarray a = src
    cdef intptr_t n
    cdef int bad = 0
    if not cnp.PyArray_IS_C_CONTIGUOUS(a):
        a = cnp.PyArray_GETCONTIGUOUS(a)
    n = cnp.PyArray_SIZE(a)
    cdef const float* p = <const float*>cnp.PyArray_DATA(a)
    if n * 4 >= RELEASE_BYTES:
        with nogil:
            bad = ttf_any_non_finite(p, n)
    else:
        bad = ttf_any_non_finite(p, n)
    return bool(bad)


def unpack_into(cnp.ndarray packed, cnp.ndarray out, ssize batch, ssize h, ssize w,
                ssize nbanks, ssize bank_stride, ssize address, ssize aligned, ssize first):
    """out: a C-contiguous float32 array of batch*h*w elements."""
    cdef const char* pp = <const char*>cnp.PyArray_DATA(packed)
    cdef char* op = <char*>cnp.PyArray_DATA(out)
    if batch * h * w * 4 >= RELEASE_BYTES:
        with nogil:
            _unpack(pp, batch, h, w, op, nbanks, bank_stride, address, aligned, first)
    else:
        _unpack(pp, batch, h, w, op, nbanks, bank_stride, address, aligned, first)
