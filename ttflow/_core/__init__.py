"""Cython for the runtime's per-command bookkeeping (below `ttflow._memory.banks`).

`_allocator`: the best-fit allocator of a memory space's address line, which every program
calls for its outputs and every freed tensor calls again. `ttflow._memory.banks` re-exports it.
"""
