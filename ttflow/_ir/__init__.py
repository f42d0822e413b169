"""The IR and the op set: programs (`program`), their builder (`builder`), what each op
computes (`ops`) and the number rules they share (`numerics`), ttflow's file format
(`binary`), `tt.simplify` (`simplify`), the L1 circular-buffer rule (`footprint`) and the
reference run (`interpreter`). Nothing here knows a device: the runtime reads programs.
"""

from . import ops as ops  # every family's records registered before any part of the IR is used
