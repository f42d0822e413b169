# Shared by the kernel modules: where page `first + t` of an interleaved buffer starts.

ctypedef Py_ssize_t ssize


cdef inline char* tile_ptr(char* base, ssize t, ssize nbanks, ssize bank_stride,
                           ssize address, ssize aligned, ssize first) noexcept nogil:
    cdef ssize page = first + t
    return base + (page % nbanks) * bank_stride + address + (page // nbanks) * aligned
