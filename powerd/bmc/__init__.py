"""BMC-managed nodes: `powerd bmc-agent` steers GPUs through their BMCs with Redfish.

- `powerd.bmc.redfish`: a thin Redfish client over httpx (sessions, retries, TLS trust);
- `powerd.bmc.backend`: a node's GPUs behind its BMC as a `GpuBackend`;
- `powerd.bmc.settings`, `powerd.bmc.agent`: the process, one node agent per BMC.
"""
