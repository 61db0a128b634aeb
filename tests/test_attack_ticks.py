"""Attack: one node poisons the tick counter at a fresh start; every later controller
restart then sends ticks the honest agents refuse.

What breaks: before its first tick a controller takes its first tick from the ticks nodes
report (statuses, acks), rejecting only a node "far above the median". At a fresh start
(agents that have applied no command yet report no tick) the hostile node IS the median,
so its `last_tick` of 2^53 - 1 is followed: the first tick is capped at MAX_TICK // 2
(4,503,599,627,370,495). Honest agents then apply ticks above MAX_TICK // 2. At the next
restart, `_first_tick` again answers min(..., MAX_TICK // 2), which is BELOW every honest
agent's last applied tick: every honest agent drops every command as `stale_tick`, its
lease runs out, and the whole fleet sits at its failsafe caps (and the controller believes
nothing, acks being "future_tick") for as many ticks as the previous controller ran: a
month of uptime, a month of failsafe.

Observed: controller 1 ran 30 ticks from 4503599627370495; controller 2 restarted at tick
4503599627370495 again; the three honest agents (last applied 4503599627370524) refused
all 10 of its first commands (no GPU steered after the restart).

Why it matters: one compromised node, one retained message, turns every later restart into
a fleet-wide loss of steering. Fix: never cap the first tick below a tick the majority of
honest nodes reported (the cap must not go under max(honest ticks) + gap); do not follow
a single node's tick when it is the only one reporting (require agreement, or start at
max(non-outlier ticks, stored tick) + gap); keep the last tick in the store/state file.
"""

from __future__ import annotations

from support.honest import NODES, HonestNode, policy_dict
from support.hostile import HOSTILE, TOPICS

from powerd.clock import ManualClock
from powerd.controller.build import build_controller
from powerd.controller.controller import Controller
from powerd.policy import parse_policy
from powerd.transport import MemoryBroker, Message
from powerd.wire import MAX_TICK, NodeState, NodeStatus, encode


def _controller(clock: ManualClock) -> Controller:
    return build_controller(parse_policy(policy_dict()), MemoryBroker().client("c"), clock)


def _run(c: Controller, clock: ManualClock, honest: dict[str, HonestNode], ticks: int) -> int:
    """Tick `ticks` times with honest agents; returns how many commands they applied."""
    applied = 0
    for _ in range(ticks):
        _, plan = c.step()
        for cmd in plan.commands:
            node = honest.get(cmd.node)
            if node is None:
                continue
            ack = node.apply(cmd.to_wire(clock.wall()))
            if ack is not None:
                applied += 1
                c.handle(Message(TOPICS.ack(node.name), ack), clock.monotonic())
                c.handle(
                    Message(
                        TOPICS.status(node.name),
                        encode(
                            NodeStatus(
                                node_id=node.name,
                                state=NodeState.STEERED,
                                last_tick=node.last_tick,
                                caps_w=node.caps,
                            )
                        ),
                    ),
                    clock.monotonic(),
                )
        for node in honest.values():
            c.handle(
                Message(TOPICS.telemetry(node.name), node.telemetry(clock.wall())),
                clock.monotonic(),
            )
        clock.advance(1.0)
    return applied


def _hello(c: Controller, clock: ManualClock, honest: dict[str, HonestNode]) -> None:
    """What a (re)started controller hears first: retained statuses, then telemetry."""
    evil = NodeStatus(node_id=HOSTILE, state=NodeState.STEERED, last_tick=2**53 - 1, caps_w={})
    c.handle(Message(TOPICS.status(HOSTILE), encode(evil)), clock.monotonic())
    for node in honest.values():
        status = NodeStatus(
            node_id=node.name,
            state=NodeState.STEERED if node.last_tick is not None else NodeState.STARTING,
            last_tick=node.last_tick,
            caps_w=node.caps,
        )
        c.handle(Message(TOPICS.status(node.name), encode(status)), clock.monotonic())
        c.handle(
            Message(TOPICS.telemetry(node.name), node.telemetry(clock.wall())), clock.monotonic()
        )


def test_a_poisoned_tick_makes_every_restart_send_ticks_honest_agents_refuse() -> None:
    clock = ManualClock(start=100.0)
    honest = {n: HonestNode(n) for n in NODES if n != HOSTILE}

    first = _controller(clock)
    _hello(first, clock, honest)
    assert _run(first, clock, honest, 30) > 0
    last_applied = max(n.last_tick or 0 for n in honest.values())

    # kill -9 and restart: the retained statuses are all a new controller hears.
    second = _controller(clock)
    _hello(second, clock, honest)
    applied = _run(second, clock, honest, 10)
    assert second.tick_no > last_applied or applied > 0, (
        f"restarted controller ticks from {second.tick_no - 9} (MAX_TICK//2 = {MAX_TICK // 2}); "
        f"honest agents last applied {last_applied}: {applied} commands applied in 10 ticks"
    )


def test_a_controller_that_ticked_before_hearing_anyone_never_catches_up() -> None:
    """Attack (no hostile node needed): the management host reboots, Mosquitto with it
    (retained statuses lost), and the agents reconnect after the controller's learning
    period (their reconnect backoff reaches 30 s; `learn_s` is one stale period).

    What breaks: the controller's first tick is chosen from what it heard; having heard no
    tick it starts at 1. The agents then republish their statuses with `last_tick` = the
    old controller's ticks, but once ticking `_tick_seen` drops every tick above ours as
    `future_tick`, so the controller never jumps ahead; every agent drops every command as
    `stale_tick` and sits in failsafe until the new ticks overtake the old ones: as many
    ticks as the old controller ran (a month of uptime, a month of failsafe), with the
    controller steering nothing and believing no ack.

    Observed: old controller ran 30 ticks (agents at tick 30); the new one ticked 1..11,
    dropped the 3 statuses it then heard as `future_tick`; 0 commands applied.

    Fix: before any node has acknowledged one of our commands, a status (or ack) above our
    tick from a node that is not an outlier must move our tick above it (+ the gap), as at
    the first tick; or keep the last tick durable (state file / store) and start above it.
    """
    clock = ManualClock(start=100.0)
    honest = {n: HonestNode(n) for n in NODES if n != HOSTILE}
    first = _controller(clock)
    for node in honest.values():
        first.handle(
            Message(TOPICS.telemetry(node.name), node.telemetry(clock.wall())), clock.monotonic()
        )
    assert _run(first, clock, honest, 30) > 0
    last_applied = max(n.last_tick or 0 for n in honest.values())

    second = _controller(clock)
    second.step()  # nothing heard yet: an empty broker after the reboot
    for node in honest.values():  # the agents are back: statuses, then telemetry
        status = NodeStatus(
            node_id=node.name,
            state=NodeState.STEERED,
            last_tick=node.last_tick,
            caps_w=node.caps,
        )
        second.handle(Message(TOPICS.status(node.name), encode(status)), clock.monotonic())
    applied = _run(second, clock, honest, 10)
    assert applied > 0, (
        f"agents last applied tick {last_applied}; the new controller ticks "
        f"{second.tick_no}: {applied} commands applied in 10 ticks, "
        f"dropped {dict(second.counters.dropped)}"
    )
