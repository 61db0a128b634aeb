"""The agents' part in a simulated run: what node agents send the controller and do with
its commands, played over the GPU model in virtual time (no broker, no processes).

Each steer the controller hears one telemetry sample per node (the model's draws, caps,
limits and perf, as an agent reads them through NVML), and every command it sends is
applied at once: caps clamped to the device's limits, then acknowledged with the limit the
device enforces. The first sample of a run goes as wire messages (`telemetry`, validated
as the controller's transport validates them); later ones go as the same values in columns
(`readings`, checked against the wire's bounds for the whole fleet at once) into
`TickEngine.on_readings`, where a wire message's handler ends up too: the engine records and
decides from them exactly as from the messages, at a fraction of the cost. Acks likewise:
what each `CapAck` would say, as columns (`AckedCaps`) into `TickEngine.on_acked`, where
`on_ack` ends up too.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from powerd.backends.mock import SimulatedGpus
from powerd.controller.fleet import NodeReadings
from powerd.safety import AckedCaps, GpuLayout, NodeCommand, SafePlan
from powerd.wire import MAX_SANE_WATTS, NodeTelemetry

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
        jobs: Sequence[str | None] = (),
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
        # Per GPU: what it reports it runs (its class).
        self.workloads: list[str | None] = list(workloads)
        # Per GPU: the job it reports (a synchronous training job's name; None: none).
        self.jobs: list[str | None] = list(jobs) or [None] * len(gpu_nodes)
        self.period_s = period_s
        self.seq = 0
        # Per node: the tick of the last command applied (None: none yet).
        self.applied: dict[str, int | None] = dict.fromkeys(names)
        self._none_for: dict[int, list[object]] = {}
        self._positions: dict[str, tuple[list[str], IntArray]] = {}
        # The last plan layout's GPUs' positions in the model (`apply_plan`).
        self._layout: GpuLayout | None = None
        self._layout_pos: IntArray = np.zeros(0, dtype=np.int64)
        # Every GPU's `set_w` (none reported), as an array (never written).
        self._no_set_w = np.full(len(gpu_nodes), math.nan)
        # The device bounds as lists, with the bytes they were listed from: kept while the
        # model's bounds stay the same (they change only with a GPU's device).
        self._bounds_listed: tuple[bytes, list[list[float]]] | None = None
        # Per node, its sample as columns: the identity and what never changes set here,
        # the readings replaced by `readings` (the constant columns are shared, never written);
        # last, the whole fleet's, the nodes' columns end to end (`fleet_readings`).
        spans = [*zip(names, self.ranges, strict=True), ("", (0, len(gpu_nodes)))]
        *self._readings, self._whole = [
            NodeReadings(
                node_id=name,
                ts=0.0,
                seq=0,
                tick=None,
                epoch=None,
                state="steered",
                uuid=self.uuids[a:b],
                index=self.gpu_index[a:b],
                name=[""] * (b - a),
                min_cap_w=[],
                max_cap_w=[],
                default_cap_w=[],
                power_w=[],
                cap_w=[],
                energy_j=[],
                temp_c=[],
                util_pct=[],
                sm_clock_mhz=[],
                perf=[],
                throttle=[()] * (b - a),
                workload=self.workloads[a:b],
                job=self.jobs[a:b],
                error=[None] * (b - a),
                set_w=[math.nan] * (b - a),
                restores=[0] * (b - a),
                found_w=[math.nan] * (b - a),
                no_errors=True,
                any_restores=False,
            )
            for name, (a, b) in spans
        ]

    def telemetry(self, ts: float) -> list[NodeTelemetry]:
        """Every node's sample now, as its agent would publish it (a wire message)."""
        return [
            NodeTelemetry.model_validate(
                {
                    "node_id": r.node_id,
                    "ts": r.ts,
                    "seq": r.seq,
                    "period_s": self.period_s,
                    "gpus": [
                        {
                            "uuid": r.uuid[k],
                            "index": r.index[k],
                            "power_w": r.power_w[k],
                            "energy_j": r.energy_j[k],
                            "cap_w": r.cap_w[k],
                            "min_cap_w": r.min_cap_w[k],
                            "max_cap_w": r.max_cap_w[k],
                            "default_cap_w": r.default_cap_w[k],
                            "temp_c": r.temp_c[k],
                            "util_pct": r.util_pct[k],
                            "sm_clock_mhz": r.sm_clock_mhz[k],
                            "perf": r.perf[k],
                            "workload": r.workload[k],
                            "job": r.job[k],
                        }
                        for k in range(len(r.uuid))
                    ],
                    "tick": r.tick,
                }
            )
            for r in self.readings(ts)
        ]

    def readings(self, ts: float) -> list[NodeReadings]:
        """Every node's sample now as columns (`TickEngine.on_readings`): the values a
        telemetry message carries, checked against the wire's bounds for the whole fleet at
        once (`check_readings`) instead of validated GPU by GPU."""
        samples, whole = self.fleet_readings(ts)
        for r, (a, b) in zip(samples, self.ranges, strict=True):
            r.power_w, r.energy_j, r.cap_w = (
                whole.power_w[a:b],
                whole.energy_j[a:b],
                whole.cap_w[a:b],
            )
            r.min_cap_w, r.max_cap_w = whole.min_cap_w[a:b], whole.max_cap_w[a:b]
            r.default_cap_w, r.temp_c = whole.default_cap_w[a:b], whole.temp_c[a:b]
            r.util_pct, r.sm_clock_mhz = whole.util_pct[a:b], whole.sm_clock_mhz[a:b]
            r.perf = whole.perf[a:b]
        return samples

    def fleet_readings(self, ts: float) -> tuple[list[NodeReadings], NodeReadings]:
        """Every node's sample now for `TickEngine.on_fleet_readings`: per node its
        identity, time, sequence and tick (its sampled columns are not filled in), and the
        whole fleet's columns end to end."""
        m = self.model
        self.seq += 1
        temp = m.temp_c.clip(-50.0, 200.0)
        util, clock = m.util_and_clock()
        perf = m.throughput()
        check_readings(
            power_w=m.power_w, energy_j=m.energy_j, cap_w=m.cap_w, min_cap_w=m.min_cap_w,
            max_cap_w=m.max_cap_w, default_cap_w=m.default_cap_w, temp_c=temp,
            util_pct=util, sm_clock_mhz=clock, perf=perf,
        )  # fmt: skip
        power, energy, cap, t, u, c, p = (
            a.tolist() for a in (m.power_w, m.energy_j, m.cap_w, temp, util, clock, perf)
        )
        lo, hi, default = self._bounds_lists()
        seq = self.seq
        # One NodeReadings per node, its header replaced each sample (the engine copies what
        # it keeps; nothing holds a sample past `on_readings`).
        applied = self.applied
        for r in self._readings:
            r.ts, r.seq, r.tick = ts, seq, applied[r.node_id]
        w = self._whole
        w.ts, w.seq = ts, seq
        w.power_w, w.energy_j, w.cap_w, w.min_cap_w, w.max_cap_w = power, energy, cap, lo, hi
        w.default_cap_w, w.temp_c, w.util_pct, w.sm_clock_mhz, w.perf = default, t, u, c, p
        # The same numbers as arrays, for the fleet's (copies: the model writes its own).
        w.arrays = {
            "min_cap_w": m.min_cap_w.copy(),
            "max_cap_w": m.max_cap_w.copy(),
            "power_w": m.power_w.copy(),
            "cap_w": m.cap_w.copy(),
            "energy_j": m.energy_j.copy(),
            "temp_c": temp,
            "perf": perf,
            "set_w": self._no_set_w,
        }
        return list(self._readings), w

    def _bounds_lists(self) -> list[list[float]]:
        """The model's min, max and default caps as lists (`fleet_readings`), listed again
        only when their bytes change (the lists are shared by samples, never written)."""
        m = self.model
        key = m.min_cap_w.tobytes() + m.max_cap_w.tobytes() + m.default_cap_w.tobytes()
        kept = self._bounds_listed
        if kept is None or kept[0] != key:
            lists = [a.tolist() for a in (m.min_cap_w, m.max_cap_w, m.default_cap_w)]
            kept = self._bounds_listed = (key, lists)
        return kept[1]

    def apply(self, commands: Sequence[NodeCommand]) -> list[tuple[NodeCommand, AckedCaps]]:
        """Apply each command's caps (clamped to the device) and acknowledge them: per
        command, what its `CapAck.gpus` would say, as columns (`TickEngine.on_acked`;
        `CapAck` epoch 0, no authority, as an agent of a controller without one sends).

        Agents apply decreases before increases; here every cap changes at the same instant
        of virtual time (the model's draw then moves with its lag), so order cannot show.
        """
        if not commands:
            return []
        m = self.model
        pos = self.position
        uuids = [list(cmd.caps_w) for cmd in commands]
        requested = [list(cmd.caps_w.values()) for cmd in commands]
        # Each node's GPUs' positions, kept while a node's commands name the same GPUs.
        where = []
        for cmd, names in zip(commands, uuids, strict=True):
            kept = self._positions.get(cmd.node)
            if kept is None or kept[0] != names:
                kept = self._positions[cmd.node] = (
                    names,
                    np.fromiter((pos[u] for u in names), dtype=np.int64, count=len(names)),
                )
            where.append(kept[1])
        idx = np.concatenate(where)
        req = np.fromiter(itertools.chain.from_iterable(requested), np.float64, count=len(idx))
        # The wire's bounds on a requested cap (GpuAck.requested_w): a command out of them
        # would be refused by an agent's transport.
        if not (np.isfinite(req) & (req >= 0.0) & (req <= MAX_SANE_WATTS)).all():
            raise ValueError("simulated agents: a command's cap is out of the wire's bounds")
        target = np.clip(req, m.min_cap_w[idx], m.max_cap_w[idx])
        # SimulatedGpus.set_cap for many GPUs at once.
        m.requested_cap_w[idx] = target
        m.cap_w[idx] = np.minimum(target, m.override_w[idx])
        enforced = m.cap_w[idx].tolist()
        out = []
        a = 0
        for cmd, node_uuids, node_req in zip(commands, uuids, requested, strict=True):
            b = a + len(node_uuids)
            self.applied[cmd.node] = cmd.tick
            none = self._none_for.get(b - a)
            if none is None:
                none = self._none_for[b - a] = [None] * (b - a)
            out.append((cmd, AckedCaps(node_uuids, node_req, enforced[a:b], none, True)))
            a = b
        return out

    def apply_plan(self, plan: SafePlan) -> FloatArray:
        """`apply(plan.commands)` with the plan's caps as columns: every command's caps
        (`plan.sent_w`, per GPU of the plan's layout) clamped to the device and set at once.
        Returns the limit each GPU enforces where a command went (NaN elsewhere), per GPU
        of the layout, for `TickEngine.on_plan_acked`: what the acks would say."""
        layout = plan.layout
        assert layout is not None
        out = np.full(layout.n_gpus, np.nan)
        if not plan.sent_nodes:
            return out
        m = self.model
        if self._layout is not layout:
            pos = self.position
            self._layout = layout
            self._layout_pos = np.fromiter(
                (pos[u] for u in layout.uuids), dtype=np.int64, count=layout.n_gpus
            )
        from powerd.sim import kernel  # numba: loaded by the first plan

        # SimulatedGpus.set_cap for many GPUs at once, each cap clamped to the device. The
        # wire's bounds on a requested cap (GpuAck.requested_w): a command out of them would
        # be refused by an agent's transport (a NaN cap, too: then the commands name more
        # GPUs than `sent_w` holds, `sent_gpus`).
        if not kernel.apply_caps(
            plan.sent_w, plan.sent_gpus, self._layout_pos, MAX_SANE_WATTS, m.min_cap_w,
            m.max_cap_w, m.override_w, m.requested_cap_w, m.cap_w, out,
        ):  # fmt: skip
            raise ValueError("simulated agents: a command's cap is out of the wire's bounds")
        self.applied.update(dict.fromkeys(plan.sent_nodes, plan.tick))
        return out


# The wire's bounds on a telemetry message's numbers (powerd.wire.GpuTelemetry).
_BOUNDS = {
    "power_w": (0.0, MAX_SANE_WATTS),
    "energy_j": (0.0, math.inf),
    "cap_w": (0.0, MAX_SANE_WATTS),
    "min_cap_w": (0.0, MAX_SANE_WATTS),
    "max_cap_w": (0.0, MAX_SANE_WATTS),
    "default_cap_w": (0.0, MAX_SANE_WATTS),
    "temp_c": (-50.0, 200.0),
    "util_pct": (0.0, 100.0),
    "sm_clock_mhz": (0.0, 10_000.0),
    "perf": (0.0, 1e12),
}


def check_readings(**columns: FloatArray) -> None:
    """The wire's bounds on a telemetry message's numbers (powerd.wire.GpuTelemetry),
    checked for every GPU at once; ValueError naming the first column out of them."""
    if _within(columns):
        return
    for name, values in columns.items():
        lo, hi = _BOUNDS[name]
        ok = np.isfinite(values) & (values >= lo) & (values <= hi)
        if name == "max_cap_w":
            ok &= values > 0.0
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise ValueError(f"simulated telemetry: GPU {bad} {name}={values[bad]!r} out of bounds")
    if (columns["min_cap_w"] > columns["max_cap_w"]).any():
        raise ValueError("simulated telemetry: a GPU's min_cap_w exceeds its max_cap_w")


# Per set of columns (their names in order): `kernel.within`'s bounds for them.
_WITHIN: dict[tuple[str, ...], tuple[FloatArray, FloatArray, NDArray[np.bool_], int, int]] = {}


def _within(columns: dict[str, FloatArray]) -> bool:
    """Whether every column passes `check_readings`, told in one compiled pass
    (kernel.within) where they are float64 vectors as a sample's are; False where any
    value may fail, or the columns are of another kind: then each is tested."""
    values = tuple(columns.values())
    if not all(
        type(v) is np.ndarray and v.dtype == np.float64 and v.ndim == 1 and v.flags.c_contiguous
        for v in values
    ):
        return False
    names = tuple(columns)
    spec = _WITHIN.get(names)
    if spec is None:
        bounds = [_BOUNDS[name] for name in names]
        pair = "min_cap_w" in names and "max_cap_w" in names
        spec = _WITHIN[names] = (
            np.array([lo for lo, _ in bounds]),
            np.array([hi for _, hi in bounds]),
            np.array([name == "max_cap_w" for name in names]),
            names.index("min_cap_w") if pair else -1,
            names.index("max_cap_w") if pair else -1,
        )
    from powerd.sim import kernel  # numba: loaded by the first check

    return bool(kernel.within(values, *spec))
