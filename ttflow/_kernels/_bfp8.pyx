# cython: language_level=3
"""BFLOAT8_B pack and unpack, a tile at a time, with the GIL released.

A tile is first gathered in face order into a 4 KiB scratch (it stays in L1 cache), then each
16-value face row is packed: its shared exponent is the largest biased exponent of its values;
each value keeps its sign and a 7-bit magnitude, the hidden 1 and the top 6 fraction bits
shifted right by (shared - own exponent), rounded once from the full 24-bit significand to
nearest with ties to even, clamped to 127. Subnormals are flushed to zero. NaN and infinity have
no encoding: the pack reports them and the caller raises.
"""

from libc.string cimport memcpy, memset
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.math cimport fabs

cimport numpy as cnp

cnp.import_array()

from ttflow._kernels._common cimport ssize, tile_ptr

cdef void _gather_tile(const char* src, ssize h, ssize w, ssize s_row, ssize s_col,
                       ssize tr, ssize tc, float* scratch) noexcept nogil:
    """Tile (tr, tc) of one (h, w) float32 slice, in face order, zero padded."""
    cdef ssize r, fc, row, col0, n, k
    cdef float* dst
    for r in range(32):
        row = tr * 32 + r
        dst = scratch + (r // 16) * 512 + (r % 16) * 16
        for fc in range(2):
            col0 = tc * 32 + fc * 16
            if row >= h or col0 >= w:
                memset(dst + fc * 256, 0, 64)
                continue
            n = w - col0
            if n > 16:
                n = 16
            if s_col == 4 and n == 16:
                memcpy(dst + fc * 256, src + row * s_row + col0 * 4, 64)
            elif s_col == 4:
                memcpy(dst + fc * 256, src + row * s_row + col0 * 4, n * 4)
            else:
                for k in range(n):
                    memcpy(dst + fc * 256 + k, src + row * s_row + (col0 + k) * s_col, 4)
            if n < 16:
                memset(dst + fc * 256 + n, 0, (16 - n) * 4)


cdef inline double _pow2(int e) noexcept nogil:
    """2**e as a double, built from its bits (e within the normal double range here)."""
    cdef uint64_t bits = <uint64_t>(1023 + e) << 52
    cdef double d
    memcpy(&d, &bits, 8)
    return d


cdef int _pack_tile(const float* scratch, uint8_t* out) noexcept nogil:
    """Packs 1024 face-ordered values into 1088 bytes; returns 1 if a NaN or inf was seen.

    |x| * 2**(133 - shared) is exact in double, and adding and removing 2**52 rounds it to an
    integer to nearest with ties to even: the same single rounding of the 24-bit significand
    that SPEC describes, without a branch per value.
    """
    cdef const uint32_t* bits = <const uint32_t*>scratch
    cdef ssize k, c
    cdef uint32_t v, e, shared
    cdef double scale, q
    cdef int bad = 0
    for k in range(64):
        shared = 0
        for c in range(16):
            e = (bits[k * 16 + c] >> 23) & 0xFF
            shared = e if e > shared else shared
        if shared == 0xFF:
            bad = 1
        out[k] = <uint8_t>shared
        scale = _pow2(133 - <int>shared)
        for c in range(16):
            v = bits[k * 16 + c]
            q = fabs(<double>scratch[k * 16 + c]) * scale
            q = (q + 6755399441055744.0) - 6755399441055744.0
            q = 127.0 if q > 127.0 else q
            q = 0.0 if ((v >> 23) & 0xFF) == 0 else q
            out[64 + k * 16 + c] = <uint8_t>(((v >> 31) << 7) | <uint32_t>q)
    return bad


cdef void _unpack_tile(const uint8_t* tile, float* scratch) noexcept nogil:
    cdef ssize k, c
    cdef uint8_t m
    cdef double scale
    cdef float value
    cdef uint32_t* out_bits = <uint32_t*>scratch
    for k in range(64):
        scale = _pow2(<int>tile[k] - 133)
        for c in range(16):
            m = tile[64 + k * 16 + c]
            scratch[k * 16 + c] = <float>((m & 0x7F) * scale)
            out_bits[k * 16 + c] |= (<uint32_t>(m >> 7)) << 31


cdef void _scatter_tile(const float* scratch, char* dst, ssize h, ssize w, ssize tr,
                        ssize tc) noexcept nogil:
    """Face-ordered tile (tr, tc) into a C-contiguous (h, w) float32 slice (logical part only)."""
    cdef ssize r, fc, row, col0, n
    for r in range(32):
        row = tr * 32 + r
        if row >= h:
            break
        for fc in range(2):
            col0 = tc * 32 + fc * 16
            if col0 >= w:
                break
            n = w - col0
            if n >= 16:
                memcpy(dst + (row * w + col0) * 4, scratch + (r // 16) * 512 + (r % 16) * 16 + fc * 256, 64)
            else:
                memcpy(dst + (row * w + col0) * 4, scratch + (r // 16) * 512 + (r % 16) * 16 + fc * 256, n * 4)


def pack_into(cnp.ndarray src, cnp.ndarray out, ssize nbanks, ssize bank_stride, ssize address,
              ssize aligned, ssize first):
    """src: a 3-D float32 array (any strides). Returns True if it held a NaN or infinity."""
    cdef const char* sp = <const char*>cnp.PyArray_DATA(src)
    cdef char* op = <char*>cnp.PyArray_DATA(out)
    cdef ssize batch = src.shape[0], h = src.shape[1], w = src.shape[2]
    cdef ssize sb = src.strides[0], sr = src.strides[1], sc = src.strides[2]
    cdef ssize th = (h + 31) // 32, tw = (w + 31) // 32
    cdef ssize b, tr, tc, t
    cdef float scratch[1024]
    cdef int bad = 0
    with nogil:
        for b in range(batch):
            for tr in range(th):
                for tc in range(tw):
                    t = (b * th + tr) * tw + tc
                    _gather_tile(sp + b * sb, h, w, sr, sc, tr, tc, scratch)
                    bad |= _pack_tile(scratch, <uint8_t*>tile_ptr(op, t, nbanks, bank_stride,
                                                                 address, aligned, first))
    return bool(bad)


def unpack_into(cnp.ndarray packed, cnp.ndarray out, ssize batch, ssize h, ssize w,
                ssize nbanks, ssize bank_stride, ssize address, ssize aligned, ssize first):
    """out: a C-contiguous float32 array of batch*h*w elements."""
    cdef const char* pp = <const char*>cnp.PyArray_DATA(packed)
    cdef char* op = <char*>cnp.PyArray_DATA(out)
    cdef ssize th = (h + 31) // 32, tw = (w + 31) // 32
    cdef ssize b, tr, tc, t
    cdef float scratch[1024]
    with nogil:
        for b in range(batch):
            for tr in range(th):
                for tc in range(tw):
                    t = (b * th + tr) * tw + tc
                    _unpack_tile(<const uint8_t*>tile_ptr(<char*>pp, t, nbanks, bank_stride,
                                                          address, aligned, first), scratch)
                    _scatter_tile(scratch, op + b * h * w * 4, h, w, tr, tc)
