"""Observation of one device: the timeline of its commands (Perfetto), the map of its address
space over time (PNG), and debug hooks on each op of a program (tt-mlir's runtime hooks).

Golden comparison and the per-op memory log sit above the mesh (`_golden`, `_memory_log`):
they drive meshes as well as devices.
"""
