"""powerd: power steering for GPU AI factories."""

import os as _os

# The allocator's linear algebra is small (Newton systems of tens to hundreds of groups,
# solved every tick): BLAS threads buy nothing there and cost ticks where the machine is
# busy. With OpenBLAS's default two threads on a two-core host whose other core was
# loaded, 79 Newton systems of up to 400 groups took 94 ms each instead of ~2 ms, and one
# tick 8.5 s instead of 0.6 s. Set before numpy loads (powerd is imported first by its
# commands); a value set in the environment wins.
for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    _os.environ.setdefault(_var, "1")

__version__ = "0.1.0"
