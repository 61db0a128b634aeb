"""powerd: power steering for GPU AI factories."""

import os as _os

# The allocator's linear algebra is small (Newton systems of tens to hundreds of groups,
# solved every tick): BLAS threads buy nothing there, and where the host's other cores are
# busy their wake-ups stretch each small solve and with it the tick
# (docs/decisions/0003-compiled-allocator.md). Set before numpy loads (powerd is imported
# first by its commands); a value set in the environment wins.
for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    _os.environ.setdefault(_var, "1")

__version__ = "0.1.0"
