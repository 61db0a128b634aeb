"""The simulator (docs/simulator.md): the shipped tick over simulated GPUs in virtual time.

The names `powerd sim` offers on its command line are here, apart from the modules that
compute (numpy, the tick), so that `powerd --help` loads neither.
"""

STATIC = "static"  # no steering: every GPU keeps its TDP as its cap, as provisioned today
STEERED = ("fast", "uniform", "priority-bands")
POLICIES = (*STEERED, STATIC)
# Baselines beside the policies (powerd/sim/baselines.py): no caps at all on the same GPUs,
# with a breaker's view of their draw; and perfect foresight, the upper bound.
UNCAPPED = "uncapped"
ORACLE = "oracle"
BASELINES = (UNCAPPED, ORACLE)

DEFAULT_FRACTIONS = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # budget sweep, shares of nameplate
DEFAULT_THRESHOLD = 0.03  # throughput loss the oversubscription search allows
DEFAULT_POINTS = 8  # site sizes on the oversubscription grid
METRICS = ("total", "weighted")
