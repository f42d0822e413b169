# cython: language_level=3
"""Pointwise float32 programs run on their pages where they lie in bank memory (no GIL).

A pagewise program (`ttflow._commands`: float32, unpadded tiles, one memory space, exactly
rounded pointwise ops) has every operand laid out alike: element j of bank row r is the same
logical element in each. So a step is one C loop per bank row over `depth` bytes. The results
are numpy's bit for bit: the same IEEE float32 operation per element, NaN propagated from the
first operand (as x86's and numpy's loops do), relu as numpy's `maximum(x, 0)` (NaN kept, -0.0
becomes 0.0). No floating point exception is raised or reported, so no `np.errstate` is needed.
"""

from libc.stdint cimport intptr_t

cimport numpy as cnp

from ttflow._kernels._common cimport RELEASE_BYTES

cnp.import_array()

OP_ADD, OP_SUB, OP_MUL, OP_RELU, OP_NEG, OP_COPY = range(6)
MAX_OPERANDS = 64

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    /* x86 (and numpy's loops on it) give a NaN operation the first operand's NaN, quieted,
       whatever the second holds. The compiler may commute a + b or a * b, which matters only
       when both are NaN: so a NaN first operand is taken explicitly (branch-free, so the loops
       stay vectorized). */
    static inline float ttf_first_nan(float a, float r) {
        uint32_t ua, ur, nan;
        memcpy(&ua, &a, 4);
        memcpy(&ur, &r, 4);
        nan = (uint32_t)0 - (uint32_t)(a != a);
        ur = (ur & ~nan) | ((ua | 0x00400000u) & nan);
        memcpy(&r, &ur, 4);
        return r;
    }

    /* One step over n floats. Operands never overlap (each value has its own storage), which
       `restrict` tells the compiler, so every loop is vectorized without runtime checks. */
    static void ttf_pointwise_step(int op, const float* __restrict a, const float* __restrict b,
                                   float s, float* __restrict out, Py_ssize_t n) {
        Py_ssize_t i;
        switch (op) {
        case 0:
            if (b) { for (i = 0; i < n; i++) out[i] = ttf_first_nan(a[i], a[i] + b[i]); }
            else { for (i = 0; i < n; i++) out[i] = ttf_first_nan(a[i], a[i] + s); }
            break;
        case 1:
            if (b) { for (i = 0; i < n; i++) out[i] = ttf_first_nan(a[i], a[i] - b[i]); }
            else { for (i = 0; i < n; i++) out[i] = ttf_first_nan(a[i], a[i] - s); }
            break;
        case 2:
            if (b) { for (i = 0; i < n; i++) out[i] = ttf_first_nan(a[i], a[i] * b[i]); }
            else { for (i = 0; i < n; i++) out[i] = ttf_first_nan(a[i], a[i] * s); }
            break;
        case 3:  /* numpy's maximum(x, 0): NaN kept, -0.0 and 0.0 give 0.0 */
            for (i = 0; i < n; i++) out[i] = (a[i] != a[i] || a[i] > 0.0f) ? a[i] : 0.0f;
            break;
        case 4:
            for (i = 0; i < n; i++) out[i] = -a[i];
            break;
        default:
            memcpy(out, a, (size_t)n * sizeof(float));
        }
    }
    """
    void ttf_pointwise_step(int op, const float* a, const float* b, float s, float* out,
                            Py_ssize_t n) nogil


def run(cnp.ndarray banks, tuple code, tuple addresses, Py_ssize_t rows, Py_ssize_t depth):
    """Runs `code` on the pages: each entry `(op, a, b, scalar, out)` names operands by their
    index in `addresses` (the lockstep address of each storage); `b < 0` takes `scalar`.
    `rows` bank rows are used, `depth` bytes deep (a multiple of 4)."""
    cdef char* base = <char*>cnp.PyArray_DATA(banks)
    cdef intptr_t stride = cnp.PyArray_STRIDES(banks)[0]
    cdef intptr_t addr[64]
    cdef Py_ssize_t k, r, count = len(addresses)
    cdef Py_ssize_t n = depth // 4
    cdef int op, a, b, o
    cdef float s
    cdef char* row
    if count > MAX_OPERANDS:
        raise ValueError(f"at most {MAX_OPERANDS} operands, got {count}")
    for k in range(count):
        addr[k] = addresses[k]
    for entry in code:
        op, a, b, s, o = entry
        if rows * depth >= RELEASE_BYTES:
            with nogil:
                for r in range(rows):
                    row = base + r * stride
                    ttf_pointwise_step(op, <float*>(row + addr[a]),
                                       <float*>(row + addr[b]) if b >= 0 else NULL,
                                       s, <float*>(row + addr[o]), n)
        else:
            for r in range(rows):
                row = base + r * stride
                ttf_pointwise_step(op, <float*>(row + addr[a]),
                                   <float*>(row + addr[b]) if b >= 0 else NULL,
                                   s, <float*>(row + addr[o]), n)
