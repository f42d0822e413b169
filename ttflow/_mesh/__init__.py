"""Meshes: chips plus links, each chip a `Device` (issue 26).

One file per job, each importing only the ones below it (import-linter checks):

    api          the public runtime calls, for a device or a mesh (`tt.to_device`, `tt.submit`, ...)
    spmd         a program on every chip of a mesh (part 2's collectives hook in here)
    trace        traces on a mesh, a trace per chip     timeline   one Perfetto file, a process per chip
    transfer     host <-> mesh: mappers split, composers join, writes
    tensor       MeshTensor: one shard `Tensor` per chip, its placement and global shape
    device       MeshDevice: open, submeshes, reshape, counters
    placement    mappers and composers (numpy only)  topology   physical links, reshape orders
    spec         MeshSpec: the system's facts (shape, chip, links)
"""
