"""The agents' part in a simulated run: what node agents send the controller and do with
its commands, played over the GPU model in virtual time (no broker, no processes).

Each steer the controller hears one telemetry message per node (the model's draws, caps,
limits and perf, as an agent reads them through NVML), and every command it sends is
applied at once: caps clamped to the device's limits, then acknowledged with the limit the
device enforces. The messages are the wire's own types, validated as they are built
(pydantic builds a validated model faster than an unvalidated one).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from powerd.backends.mock import SimulatedGpus
from powerd.safety import NodeCommand
from powerd.wire import CapAck, GpuAck, NodeTelemetry

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]


class SimAgents:
    """One agent per node of a site whose GPUs are contiguous per node (`gpu_nodes`, per GPU
    its node's name, in the model's GPU order)."""

    def __init__(
        self,
        model: SimulatedGpus,
        gpu_nodes: Sequence[str],
        workloads: Sequence[str],
        *,
        period_s: float,
    ) -> None:
        names: list[str] = []
        bounds = [0]
        for i, node in enumerate(gpu_nodes):
            if not names or names[-1] != node:
                if names:
                    bounds.append(i)
                names.append(node)
        bounds.append(len(gpu_nodes))
        self.model = model
        self.names = names
        self.ranges = list(itertools.pairwise(bounds))
        self.uuids = list(model.uuids)
        self.gpu_index = [i - a for a, b in self.ranges for i in range(a, b)]
        self.position = {u: i for i, u in enumerate(self.uuids)}
        self.workloads = list(workloads)  # per GPU: what it reports it runs (its class)
        self.period_s = period_s
        self.seq = 0
        # Per node: the tick of the last command applied (None: none yet).
        self.applied: dict[str, int | None] = dict.fromkeys(names)
        # Per GPU: the last ack and what it said; most GPUs get the same cap again, and
        # their ack is then the same object (NaN: none yet, so a GPU's first is made).
        n = len(self.uuids)
        none_yet = GpuAck.model_construct(requested_w=0.0, enforced_w=None, error=None)
        self._acks: list[GpuAck] = [none_yet] * n
        self._ack_req = np.full(n, np.nan)
        self._ack_enf = np.full(n, np.nan)

    def telemetry(self, ts: float) -> list[NodeTelemetry]:
        """Every node's sample now, as its agent would publish it."""
        m = self.model
        self.seq += 1
        columns = zip(
            self.uuids,
            self.gpu_index,
            m.power_w.tolist(),
            m.energy_j.tolist(),
            m.cap_w.tolist(),
            m.min_cap_w.tolist(),
            m.max_cap_w.tolist(),
            m.default_cap_w.tolist(),
            np.clip(m.temp_c, -50.0, 200.0).tolist(),
            m.util_pct().tolist(),
            m.sm_clock_mhz().tolist(),
            m.throughput().tolist(),
            self.workloads,
            strict=True,
        )
        keys = (
            "uuid", "index", "power_w", "energy_j", "cap_w", "min_cap_w", "max_cap_w",
            "default_cap_w", "temp_c", "util_pct", "sm_clock_mhz", "perf", "workload",
        )  # fmt: skip
        gpus = [dict(zip(keys, row, strict=True)) for row in columns]
        # One validation per node, of plain values (cheaper than a model per GPU).
        return [
            NodeTelemetry.model_validate(
                {
                    "node_id": name,
                    "ts": ts,
                    "seq": self.seq,
                    "period_s": self.period_s,
                    "gpus": gpus[a:b],
                    "tick": self.applied[name],
                }
            )
            for name, (a, b) in zip(self.names, self.ranges, strict=True)
        ]

    def apply(self, commands: Sequence[NodeCommand], ts: float) -> list[CapAck]:
        """Apply each command's caps (clamped to the device) and acknowledge them.

        Agents apply decreases before increases; here every cap changes at the same instant
        of virtual time (the model's draw then moves with its lag), so order cannot show.
        """
        if not commands:
            return []
        m = self.model
        pos = self.position
        idx_list: list[int] = []
        req_list: list[float] = []
        for cmd in commands:
            for u, w in cmd.caps_w.items():
                idx_list.append(pos[u])
                req_list.append(w)
        idx = np.asarray(idx_list, dtype=np.int64)
        req = np.asarray(req_list, dtype=np.float64)
        target = np.clip(req, m.min_cap_w[idx], m.max_cap_w[idx])
        # SimulatedGpus.set_cap for many GPUs at once.
        m.requested_cap_w[idx] = target
        m.cap_w[idx] = np.minimum(target, m.override_w[idx])
        enforced = m.cap_w[idx]
        changed = (req != self._ack_req[idx]) | (enforced != self._ack_enf[idx])
        for i, r, e in zip(
            idx[changed].tolist(), req[changed].tolist(), enforced[changed].tolist(), strict=True
        ):
            self._acks[i] = GpuAck(requested_w=r, enforced_w=e)
        self._ack_req[idx] = req
        self._ack_enf[idx] = enforced
        acks = []
        for cmd in commands:
            self.applied[cmd.node] = cmd.tick
            gpus = {u: self._acks[pos[u]] for u in cmd.caps_w}
            acks.append(
                CapAck(
                    node_id=cmd.node,
                    tick=cmd.tick,
                    epoch=0,
                    authority=None,
                    gpus=gpus,
                    ts=ts,
                )
            )
        return acks
