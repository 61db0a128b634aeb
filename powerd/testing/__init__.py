"""powerd's testing kit: what its tests, benches and chaos harness run against, shipped so
that a deployment's own tests can too.

- `powerd.testing.mosquitto`: a private Mosquitto on a free loopback port, which a test can
  kill and start again (the `mosquitto` binary must be installed);
- `powerd.testing.synthetic`: policies of any size whose budgets all bind, and seeded
  random fleets, for allocator and planner tests and benchmarks.
- `powerd.testing.redfish`: a Redfish BMC and PDU emulator over HTTPS (sessions, GPU power
  limits backed by the mock physics, slow, failing and lying variants), checked with the
  DMTF's `redfish-service-validator`.

Nothing in the daemons imports this package (tests/test_layers.py checks it).
"""
