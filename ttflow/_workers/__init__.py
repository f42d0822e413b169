"""Where a device's records run (`open_device(workers=...)`): a queue's own thread in the host
(`thread`, the default), a worker process on this machine (`process`, the host's side; `child`,
the process's), a Ray actor anywhere on a cluster (`ray`). Records travel to a process or actor
in wire form (`wire`); chips in different processes meet for collectives over their endpoints
(`endpoint`). docs/workers.md tells the whole model."""
