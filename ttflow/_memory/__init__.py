"""Memory: bank memory and its allocators, buffers and storages at real addresses (`banks`),
and a value between host arrays and bank storages (`storage_io`). No tensor lives here.
"""
