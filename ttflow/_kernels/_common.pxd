# Shared by the kernel modules: where page `first + t` of an interleaved buffer starts.

ctypedef Py_ssize_t ssize


cdef inline char* tile_ptr(char* base, ssize t, ssize nbanks, ssize bank_stride,
                           ssize address, ssize aligned, ssize first) noexcept nogil:
    cdef ssize page = first + t
    return base + (page % nbanks) * bank_stride + address + (page // nbanks) * aligned


# Kernels release the GIL only for work of at least this many bytes. A release lets a waiting
# thread take the GIL, and taking it back waits until that thread gives it up, which under
# CPython's switch interval can take milliseconds: on a small array (microseconds of work) the
# hand-off costs far more than the parallelism gains (measured: a 64x64 training step spent
# most of its device time waiting for the GIL after one-tile kernels).
cdef enum:
    RELEASE_BYTES = 262144
