"""A chaos harness: real powerd processes, a real broker and database, scripted faults, and
an outside watcher that checks every budget against the caps actually in force.

- `watcher`: ground truth from the mock backend's cap journals (one per agent, written by
  the agents' own processes), budgets in force (policy, temporary cuts with their grace),
  breaches with their worst overshoot; plus the broker's traffic for context (ticks, acks,
  states) and recovery.
- `site`: the processes (Mosquitto, controller, agents behind loopback TCP proxies) and the
  faults they can suffer.
- `schedule`: faults as a declarative list (at t, do what), the short and the soak lists.
- `run`: carries out a schedule and reports figures.

It lives in the package (not under tests/) so that the test suite and bench/chaos.py share
one type-checked copy, and so that a release can be soaked on a staging host from its
installed wheel. See docs/safety.md, "Chaos harness".
"""
