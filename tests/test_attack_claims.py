"""Attack: a node that names another node's GPUs first owns them for good; the real
node's GPUs are never steered again.

What breaks: a GPU uuid belongs to the first node whose telemetry names it; a second node
naming it is the "claimant", its readings are ignored, and the holder keeps it as long as
it keeps naming it. After a controller (re)start nothing is known, so a hostile node that
publishes telemetry naming a neighbour's uuids (within its own inventory of 4) before the
neighbour's first telemetry (a flood at every start does it) becomes their holder. The
controller then sends those caps to the hostile node, counts them in the hostile node's
rack, and the real node (r2-n2 here, in the other rack) gets no command at all: its GPUs
sit at their failsafe caps forever, and its reserve (missing GPUs at their maximum) costs
its rack 2,800 W of budget for nothing. The `gpu_claimed_twice` alarm fires, but no claim
ever resolves: the hostile node keeps naming them.

Observed: after 10 ticks, all 4 GPUs of r2-n2 are held by r1-n1; r2-n2 received 0
commands; r1-n1 received 10 commands carrying r2-n2's uuids.

Why it matters: the hardening promises that a node's messages reach only its own GPUs; here
one compromised node takes control (and the budget accounting) of a neighbour's GPUs in
another rack. Fix: bind uuids to nodes by something the hostile node cannot forge first
(the node's own retained status/acks, an inventory in the policy or the store), or, on a
claim, give the GPU to neither and let the uuid follow the node whose agent acknowledges
commands for it.
"""

from __future__ import annotations

import json

from test_hostile import HOSTILE, NODES, TOPICS, HonestNode, gpu_dict, policy_dict

from powerd.clock import ManualClock
from powerd.controller.controller import Controller
from powerd.policy import parse_policy
from powerd.transport import MemoryBroker, Message

VICTIM = "r2-n2"


def test_a_node_naming_a_neighbours_gpus_first_takes_them_over() -> None:
    clock = ManualClock(start=100.0)
    c = Controller(parse_policy(policy_dict()), MemoryBroker().client("c"), clock)
    honest = {n: HonestNode(n) for n in NODES if n != HOSTILE}
    stolen = honest[VICTIM].uuids
    seq = 0

    def evil_telemetry() -> bytes:
        nonlocal seq
        seq += 1
        gpus = [gpu_dict(u, i, cap_w=200.0, power_w=150.0) for i, u in enumerate(stolen)]
        msg = {"v": 1, "node_id": HOSTILE, "ts": 0.0, "seq": seq, "period_s": 1.0, "gpus": gpus}
        return json.dumps(msg).encode()

    to_victim = 0
    to_hostile_stolen = 0
    for _ in range(10):
        # The hostile node publishes fast: its sample lands first after the (re)start.
        c.handle(Message(TOPICS.telemetry(HOSTILE), evil_telemetry()), clock.monotonic())
        for n in honest.values():
            c.handle(
                Message(TOPICS.telemetry(n.name), n.telemetry(clock.wall())), clock.monotonic()
            )
        clock.advance(1.0)
        _, plan = c.step()
        for cmd in plan.commands:
            if cmd.node == VICTIM:
                to_victim += 1
            if cmd.node == HOSTILE and set(stolen) & set(cmd.caps_w):
                to_hostile_stolen += 1
            node = honest.get(cmd.node)
            if node is not None:
                ack = node.apply(cmd.to_wire(clock.wall()))
                if ack is not None:
                    c.handle(Message(TOPICS.ack(cmd.node), ack), clock.monotonic())

    holders = {u: c.fleet.gpus[u].node for u in stolen if u in c.fleet.gpus}
    assert holders == dict.fromkeys(stolen, VICTIM) and to_victim > 0, (
        f"{VICTIM}'s GPUs held by {sorted(set(holders.values()))}; {VICTIM} got {to_victim} "
        f"commands in 10 ticks, {HOSTILE} got {to_hostile_stolen} carrying {VICTIM}'s uuids"
    )
