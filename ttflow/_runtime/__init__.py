"""The runtime face: what a front-end calls on one device, one file per job.

`device` (the hardware: bank memory, allocators, CQ0 and CQ1, and its public face), `tensor`
(the user's handle), `const_eval` (the constant part of a program, run once and cached),
`calls` (to_device, submit, to_host, ...: validate, then hand to the scheduler) and `trace`
(capture_trace, execute_trace). A mesh's calls are `_mesh.api`'s, above this package.
"""
