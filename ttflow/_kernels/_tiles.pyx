# cython: language_level=3
"""Tilize/untilize and interleaved page copies, on raw bytes, with the GIL released.

The loops are C (`_tiles.h`, which says why each runs in the order it does); this module hands
them the arrays' pointers and strides. Everything here works on element sizes of 2 or 4 bytes;
the public checks live in `ttflow.kernels`. A tile's place is resolved through the interleaving
formula (`ttf_page`), so the same loop tilizes into a flat buffer (one bank, no gaps) or straight
into bank memory (`*_to_banks`), which saves a pass over the data.
"""

from libc.stdint cimport intptr_t

cimport numpy as cnp

from ttflow._kernels._common cimport RELEASE_BYTES

cdef extern from "_tiles.h" nogil:
    ctypedef struct ttf_pages:
        char* base
        intptr_t nbanks, bank_stride, address, aligned, first
    intptr_t TTF_STREAM_BYTES
    void ttf_tilize(const char* src, intptr_t batch, intptr_t h, intptr_t w, intptr_t s_batch,
                    intptr_t s_row, intptr_t s_col, intptr_t es, const ttf_pages* out,
                    int stream)
    int ttf_untilize(const ttf_pages* tiles, intptr_t batch, intptr_t h, intptr_t w,
                     intptr_t es, char* out, int stream)
    void ttf_scatter(const char* src, intptr_t num_pages, intptr_t page_size,
                     const ttf_pages* out, int stream)
    void ttf_gather(const ttf_pages* pages, intptr_t num_pages, intptr_t page_size, char* dst,
                    int stream)

cnp.import_array()

ctypedef Py_ssize_t ssize

STREAM_BYTES = TTF_STREAM_BYTES
"""Outputs larger than this are written with streaming (non-temporal) stores."""


cdef inline ttf_pages _pages(cnp.ndarray base, ssize nbanks, ssize bank_stride, ssize address,
                             ssize aligned, ssize first):
    cdef ttf_pages p
    p.base = <char*>cnp.PyArray_DATA(base)
    p.nbanks = nbanks
    p.bank_stride = bank_stride
    p.address = address
    p.aligned = aligned
    p.first = first
    return p


def tilize_into(cnp.ndarray src, cnp.ndarray out, ssize nbanks, ssize bank_stride,
                ssize address, ssize aligned, ssize first):
    """src: a 3-D (batch, h, w) array of 2- or 4-byte elements, any strides. out: the bytes to fill."""
    cdef const char* sp = <const char*>cnp.PyArray_DATA(src)
    cdef ttf_pages p = _pages(out, nbanks, bank_stride, address, aligned, first)
    cdef ssize batch = src.shape[0], h = src.shape[1], w = src.shape[2]
    cdef ssize sb = src.strides[0], sr = src.strides[1], sc = src.strides[2]
    cdef ssize es = src.itemsize
    cdef int stream = batch * h * w * es > TTF_STREAM_BYTES
    if batch * h * w * es >= RELEASE_BYTES:
        with nogil:
            ttf_tilize(sp, batch, h, w, sb, sr, sc, es, &p, stream)
    else:
        ttf_tilize(sp, batch, h, w, sb, sr, sc, es, &p, stream)


def untilize_into(cnp.ndarray tiles, cnp.ndarray out, ssize batch, ssize h, ssize w,
                  ssize nbanks, ssize bank_stride, ssize address, ssize aligned, ssize first):
    """tiles: the bytes holding the tiles; out: a C-contiguous result of batch*h*w elements."""
    cdef ttf_pages p = _pages(tiles, nbanks, bank_stride, address, aligned, first)
    cdef char* op = <char*>cnp.PyArray_DATA(out)
    cdef ssize es = out.itemsize
    cdef int stream = batch * h * w * es > TTF_STREAM_BYTES
    cdef int ok
    if batch * h * w * es >= RELEASE_BYTES:
        with nogil:
            ok = ttf_untilize(&p, batch, h, w, es, op, stream)
    else:
        ok = ttf_untilize(&p, batch, h, w, es, op, stream)
    if not ok:
        raise MemoryError("untilize: no memory for the tile row's pointers")


def scatter(cnp.ndarray pages, cnp.ndarray banks, ssize num_pages, ssize page_size,
            ssize address, ssize aligned, ssize first):
    """Page j of the contiguous `pages` to page first+j of an interleaved buffer."""
    cdef const char* src = <const char*>cnp.PyArray_DATA(pages)
    cdef ttf_pages p = _pages(banks, banks.shape[0], banks.shape[1], address, aligned, first)
    cdef int stream = num_pages * page_size > TTF_STREAM_BYTES
    if num_pages * page_size >= RELEASE_BYTES:
        with nogil:
            ttf_scatter(src, num_pages, page_size, &p, stream)
    else:
        ttf_scatter(src, num_pages, page_size, &p, stream)


def gather(cnp.ndarray banks, cnp.ndarray out, ssize num_pages, ssize page_size,
           ssize address, ssize aligned, ssize first):
    """Pages first.. of an interleaved buffer into the contiguous `out`."""
    cdef char* dst = <char*>cnp.PyArray_DATA(out)
    cdef ttf_pages p = _pages(banks, banks.shape[0], banks.shape[1], address, aligned, first)
    cdef int stream = num_pages * page_size > TTF_STREAM_BYTES
    if num_pages * page_size >= RELEASE_BYTES:
        with nogil:
            ttf_gather(&p, num_pages, page_size, dst, stream)
    else:
        ttf_gather(&p, num_pages, page_size, dst, stream)
