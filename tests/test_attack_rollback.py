"""Attack: a write the API answers as "not applied" (state file unwritable, rolled back)
was in force, and steered the fleet, while the state file was being written.

What breaks: `Ledger.commit` applies the change in memory first, then awaits the state file
write in a worker thread; the event loop, and with it the tick loop, keeps running. When
the write then fails, a change that does not only lower power is rolled back and the API
answers 503 `applied: false`. But every tick that ran during the write steered with the
change in force. Here an operator ends a grid demand-response cut (`DELETE /budgets/dc`,
facility 7,000 W → cut 4,000 W) while the state file's disk hangs and then fails (fsync
EIO, a full or read-only disk that takes its time): the ticks in between raise the fleet
to the policy's 7,000 W, the answer says the cut was never lifted, and the audit row says
"rolled back".

Observed: within four ticks of the hung write the 16 GPUs' caps in force rose from
4,000 W to 7,000 W (the cut exceeded by 3,000 W, 75 %); then `WriteFailed(applied=False)`
and the cut is back in memory as if it had never been lifted.

Why it matters: "answers say exactly what happened" and "a temporary budget binds until it
is cleared" both fail: the grid operator's limit was exceeded by a change that officially
never happened. Fix: make the state file durable BEFORE applying a change that raises power
(write the would-be state, then apply), or have the tick read the last durable overrides
(apply raises only once `_save` returned ok); lowering changes may keep applying first.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from support.honest import NODES, HonestNode, policy_dict
from support.hostile import TOPICS

from powerd.clock import ManualClock
from powerd.controller.admin import WriteFailed
from powerd.controller.build import build_controller
from powerd.controller.controller import Controller
from powerd.controller.opstate import OperatorState, StateFile, StateFileError
from powerd.controller.overrides import BudgetOverride
from powerd.policy import parse_policy
from powerd.transport import MemoryBroker, Message

CUT_W = 4000.0


class HangingStateFile(StateFile):
    """A state file on a disk that hangs, then fails, once `hang` is armed."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.hang = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def save(self, state: OperatorState) -> None:
        if not self.hang:
            super().save(state)
            return
        self.entered.set()
        self.release.wait(10)
        raise StateFileError(f"{self.path}: [Errno 5] Input/output error")


def exchange(c: Controller, clock: ManualClock, nodes: dict[str, HonestNode], plan: Any) -> None:
    for cmd in plan.commands:
        ack = nodes[cmd.node].apply(cmd.to_wire(clock.wall()))
        if ack is not None:
            c.handle(Message(TOPICS.ack(cmd.node), ack), clock.monotonic())
    for n in nodes.values():
        c.handle(Message(TOPICS.telemetry(n.name), n.telemetry(clock.wall())), clock.monotonic())
    clock.advance(1.0)


def total_w(nodes: dict[str, HonestNode]) -> float:
    return sum(sum(n.caps.values()) for n in nodes.values())


@pytest.mark.asyncio
async def test_a_rolled_back_budget_clear_was_in_force_while_the_state_file_hung(
    tmp_path: Path,
) -> None:
    clock = ManualClock(start=100.0)
    state_file = HangingStateFile(tmp_path / "state.json")
    c = build_controller(
        parse_policy(policy_dict()), MemoryBroker().client("c"), clock, state_file=state_file
    )
    nodes = {n: HonestNode(n) for n in NODES}
    for n in nodes.values():
        c.handle(Message(TOPICS.telemetry(n.name), n.telemetry(clock.wall())), clock.monotonic())

    def cut() -> None:
        c.set_budget("dc", CUT_W, expires_at=None, actor="grid", reason="DR event")

    await c.ledger.commit(cut, lowers_power=True)
    for _ in range(8):
        _, plan = c.step()
        exchange(c, clock, nodes, plan)
    assert total_w(nodes) <= CUT_W + 1e-6
    assert total_w(nodes) > 3000.0  # steered up to the cut, not parked at failsafe

    state_file.hang = True
    write = asyncio.create_task(
        c.ledger.commit(
            lambda: c.clear_budget("dc", actor="grid", reason="DR event over"),
            lowers_power=False,
        )
    )
    assert await asyncio.to_thread(state_file.entered.wait, 10)
    # The disk hangs for a few ticks; the tick loop runs on meanwhile.
    worst = total_w(nodes)
    for _ in range(4):
        _, plan = c.step()
        exchange(c, clock, nodes, plan)
        worst = max(worst, total_w(nodes))
    state_file.release.set()
    with pytest.raises(WriteFailed) as failed:
        await write
    assert failed.value.outcome.applied is False
    assert isinstance(c.overrides.budgets.get("dc"), BudgetOverride)  # "never lifted"

    assert worst <= CUT_W + 1e-6, (
        f"a clear answered `applied: false` raised the caps in force to {worst:.0f} W "
        f"under a {CUT_W:.0f} W cut that officially stayed in force ({worst - CUT_W:.0f} W over)"
    )
