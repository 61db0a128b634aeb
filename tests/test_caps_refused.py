"""The `caps_refused` alarm names every GPU that refuses its caps, including one that starts
refusing while the alarm is already active (its message used to stay as first raised)."""

from __future__ import annotations

from support.honest import NODES, HonestNode, policy_dict

from powerd.alarms import Alarms
from powerd.controller.tick import TickEngine
from powerd.policy import parse_policy
from powerd.wire import AckError, CapAck, GpuAck


class RefusingNode(HonestNode):
    """An honest node whose GPUs in `refusing` fail every set (ack `set_failed`)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.refusing: set[str] = set()

    def apply_caps(self, tick: int, caps_w: dict[str, float]) -> CapAck | None:  # type: ignore[override]
        kept = {u: self.caps[u] for u in self.refusing}
        ack = super().apply_caps(tick, caps_w)
        if ack is None:
            return None
        self.caps.update(kept)
        gpus = {
            u: GpuAck(requested_w=g.requested_w, error=AckError.SET_FAILED)
            if u in self.refusing
            else g
            for u, g in ack.gpus.items()
        }
        return ack.model_copy(update={"gpus": gpus})


def test_a_gpu_refusing_after_the_alarm_was_raised_is_named() -> None:
    engine = TickEngine(parse_policy(policy_dict()))
    nodes = {n: RefusingNode(n) for n in NODES}
    first, later = nodes["r1-n1"].uuids[0], nodes["r2-n2"].uuids[1]
    seen: list[str] = []
    for t in range(16):
        if t == 3:
            nodes["r1-n1"].refusing.add(first)
        if t == 8:
            nodes["r2-n2"].refusing.add(later)
        for node in nodes.values():
            engine.on_telemetry(node.sample(1e9 + t), float(t))
        _, plan = engine.step(float(t), 1e9 + t)
        for cmd in plan.commands:
            ack = nodes[cmd.node].apply_caps(cmd.tick, dict(cmd.caps_w))
            if ack is not None:
                engine.on_ack(cmd.node, ack)
        message = engine.alarms.active.get("caps_refused")
        if message is not None:
            seen.append(message)
    assert seen, "caps_refused never raised"
    assert first in seen[0]
    assert first in seen[-1] and later in seen[-1]
    assert seen[-1].startswith("2 GPU(s) refuse their caps")


def test_an_active_alarm_without_subjects_says_what_is_true_now() -> None:
    """The class of the fault above: an alarm raised without subjects whose message changes
    (budget_over naming other groups) kept its first text for as long as it was active."""
    alarms = Alarms()
    alarms.set("budget_over", "committed caps above budget at r1", 1.0)
    alarms.set("budget_over", "committed caps above budget at r1, r2", 2.0)
    assert alarms.active["budget_over"] == "committed caps above budget at r1, r2"
    alarms.set("budget_over", None, 3.0)
    assert "budget_over" not in alarms.active
