# cython: language_level=3
"""The best-fit allocator of one address line, in C (`ttflow._memory` re-exports it).

Every program allocates its outputs and frees what its inputs' dropped handles held, so the
allocator is on dispatch's hot path. The free list is a sorted C array of (start, size) blocks,
scanned for the best fit and edited in place; the used blocks are a dict (address -> size).
"""

from libc.stdlib cimport free as c_free, realloc
from libc.string cimport memmove

ctypedef long long i64


cdef class Allocator:
    """Best-fit over one address line [0, size), coalescing frees; bottom-up or top-down.

    Among free blocks that fit, the smallest is taken (ties: the lowest address bottom-up, the
    highest top-down); the allocation sits at the block's bottom or top end accordingly.
    """

    cdef readonly i64 size
    cdef readonly i64 alignment
    cdef readonly bint top_down
    cdef readonly i64 used_bytes
    cdef i64* _starts
    cdef i64* _sizes
    cdef Py_ssize_t _count, _capacity
    cdef dict _used

    def __cinit__(self, i64 size, i64 alignment, bint top_down):
        self._capacity = 16
        self._starts = <i64*>realloc(NULL, self._capacity * sizeof(i64))
        self._sizes = <i64*>realloc(NULL, self._capacity * sizeof(i64))
        if self._starts == NULL or self._sizes == NULL:
            raise MemoryError()
        self._count = 0

    def __init__(self, i64 size, i64 alignment, bint top_down):
        self.size = size - size % alignment
        self.alignment = alignment
        self.top_down = top_down
        self.used_bytes = 0
        self._used = {}
        if self.size:
            self._starts[0] = 0
            self._sizes[0] = self.size
            self._count = 1

    def __dealloc__(self):
        c_free(self._starts)
        c_free(self._sizes)

    @property
    def largest_free(self):
        cdef i64 best = 0
        cdef Py_ssize_t i
        for i in range(self._count):
            if self._sizes[i] > best:
                best = self._sizes[i]
        return best

    def free_blocks(self):
        return [(self._starts[i], self._sizes[i]) for i in range(self._count)]

    def allocations(self):
        return dict(self._used)

    cdef void _insert(self, Py_ssize_t i, i64 start, i64 size) except *:
        if self._count == self._capacity:
            self._capacity *= 2
            starts = <i64*>realloc(self._starts, self._capacity * sizeof(i64))
            if starts == NULL:
                raise MemoryError()
            self._starts = starts
            sizes = <i64*>realloc(self._sizes, self._capacity * sizeof(i64))
            if sizes == NULL:
                raise MemoryError()
            self._sizes = sizes
        memmove(&self._starts[i + 1], &self._starts[i], (self._count - i) * sizeof(i64))
        memmove(&self._sizes[i + 1], &self._sizes[i], (self._count - i) * sizeof(i64))
        self._starts[i] = start
        self._sizes[i] = size
        self._count += 1

    cdef void _remove(self, Py_ssize_t i):
        memmove(&self._starts[i], &self._starts[i + 1], (self._count - i - 1) * sizeof(i64))
        memmove(&self._sizes[i], &self._sizes[i + 1], (self._count - i - 1) * sizeof(i64))
        self._count -= 1

    cpdef object allocate(self, object nbytes):
        """The address of a new block of at least `nbytes`, or None when no free block fits."""
        if nbytes > self.size:  # also any size beyond 64 bits
            return None
        cdef i64 n = nbytes
        cdef i64 size = ((n if n > 1 else 1) + self.alignment - 1) // self.alignment * self.alignment
        cdef Py_ssize_t i, best = -1
        cdef i64 block, best_size = 0, address
        for i in range(self._count):
            block = self._sizes[i]
            if block < size:
                continue
            if best < 0 or block < best_size or (block == best_size and self.top_down):
                best = i
                best_size = block
        if best < 0:
            return None
        if best_size == size:
            address = self._starts[best]
            self._remove(best)
        elif self.top_down:
            self._sizes[best] = best_size - size
            address = self._starts[best] + best_size - size
        else:
            address = self._starts[best]
            self._starts[best] = address + size
            self._sizes[best] = best_size - size
        self._used[address] = size
        self.used_bytes += size
        return address

    cpdef bint claim(self, i64 start, i64 nbytes):
        """Takes [start, start + nbytes) (rounded up to the alignment) if it is wholly free:
        a placement at a given address, as tt-metal places a program's circular buffers at the
        bottom of L1. False, changing nothing, when any of it is in use."""
        if nbytes <= 0 or start < 0 or start % self.alignment:
            return False
        cdef i64 size = (nbytes + self.alignment - 1) // self.alignment * self.alignment
        cdef i64 end = start + size, block_end
        cdef Py_ssize_t i
        for i in range(self._count):
            if self._starts[i] > start:
                return False
            block_end = self._starts[i] + self._sizes[i]
            if block_end < end:
                continue
            # block i holds [start, end): keep what is left of it on either side
            if self._starts[i] == start:
                if block_end == end:
                    self._remove(i)
                else:
                    self._starts[i] = end
                    self._sizes[i] = block_end - end
            else:
                self._sizes[i] = start - self._starts[i]
                if block_end > end:
                    self._insert(i + 1, end, block_end - end)
            self._used[start] = size
            self.used_bytes += size
            return True
        return False

    @property
    def bottom_free(self):
        """Bytes free from address 0 up to the lowest allocation (what a claim at 0 may take)."""
        if self._count and self._starts[0] == 0:
            return self._sizes[0]
        return 0

    cpdef free(self, i64 address):
        cdef i64 size = self._used.pop(address)
        cdef i64 start = address, end = address + size
        cdef Py_ssize_t lo = 0, hi = self._count, mid, i
        self.used_bytes -= size
        while lo < hi:  # the first free block at or after `start`
            mid = (lo + hi) // 2
            if self._starts[mid] < start:
                lo = mid + 1
            else:
                hi = mid
        i = lo
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:
            i -= 1
            start = self._starts[i]
            if i + 1 < self._count and self._starts[i + 1] == end:
                self._sizes[i] = self._starts[i + 1] + self._sizes[i + 1] - start
                self._remove(i + 1)
            else:
                self._sizes[i] = end - start
        elif i < self._count and self._starts[i] == end:
            self._starts[i] = start
            self._sizes[i] += size
        else:
            self._insert(i, start, size)
