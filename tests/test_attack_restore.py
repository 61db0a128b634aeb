"""Attack: a restart silently forgets a temporary budget that the policy in force had
(for now) made redundant; once the policy is put back, the cut is gone.

What breaks: while running, a temporary budget stays in `overrides` whatever the policy
does (the budget in force is min(policy, temporary)). At a start, `opstate.restore` re-adds
each stored temporary budget through `Overrides.set_budget`, which refuses one above the
policy's budget of the moment: the cut is dropped with a log line only, and the next state
file write loses it for good. Sequence: a grid demand-response cut on rack r1 (3,500 W,
2 h); an admin lowers r1 to 3,000 W in the policy (breaker work) through the API; the
controller restarts (crash, upgrade); the breaker work ends and the admin puts the policy
back (3,800 W). A controller that did not restart keeps r1 at 3,500 W (the cut, still
within its 2 h); the restarted one lets r1 run to 3,800 W, 300 W above the grid operator's
limit, and `GET /overrides` no longer shows the cut. No alarm, no audit row.

Observed: budget in force on r1 after the policy revert: 3,500 W without a restart,
3,800 W with one.

Why it matters: "what an operator did survives restarts" is false for exactly the cut a
grid event depends on; a restart changes the power picture. Fix: restore a stored
temporary budget as stored (it only binds through min(policy, temporary)); never drop an
operator's cut at start except for an expiry or a group that no longer exists, and then
audit/alarm it.
"""

from __future__ import annotations

from typing import Any

import yaml
from support.honest import policy_dict

from powerd.clock import ManualClock
from powerd.controller.build import StartState, build_controller
from powerd.controller.controller import Controller
from powerd.policy import parse_policy
from powerd.transport import MemoryBroker


def policy_text(rack_w: float) -> str:
    d: dict[str, Any] = policy_dict()
    # r1 and r2 expanded by name so that r1 alone can change.
    rack = d["facility"]["rows"][0]["racks"][0]
    r1 = dict(rack, name="r1", budget_w=rack_w)
    r2 = dict(rack, name="r2")
    d["facility"]["rows"][0]["racks"] = [r1, r2]
    return yaml.safe_dump(d)


def test_a_restart_forgets_a_cut_the_policy_made_redundant_for_a_while() -> None:
    clock = ManualClock(start=1_000.0)
    normal, breaker_work = policy_text(3800), policy_text(3000)

    def controller(text: str, start: StartState | None = None) -> Controller:
        policy = parse_policy(yaml.safe_load(text))
        transport = MemoryBroker().client("c")
        return build_controller(policy, transport, clock, start=start or StartState())

    kept = controller(normal)
    kept.set_budget("r1", 3500, expires_at=clock.wall() + 7200, actor="grid", reason="DR-7")
    kept.replace_policy(breaker_work, actor="alice", reason="breaker work on r1")
    assert kept.budget_in_force_w("r1") == 3000
    state = kept.ledger.state()  # what the state file holds at this moment

    # kill -9, restart: the policy file is unchanged, so the API's policy stays in force.
    clock.advance(60)
    restarted = controller(
        breaker_work, StartState(state, state.api_policy, file_revision=state.revision)
    )

    # The breaker work is over: the admin puts the normal policy back, on both.
    clock.advance(60)
    for c in (kept, restarted):
        c.replace_policy(normal, actor="alice", reason="breaker work done")

    assert kept.budget_in_force_w("r1") == 3500  # the grid cut, 2 h not yet over
    assert restarted.budget_in_force_w("r1") == kept.budget_in_force_w("r1"), (
        f"after a restart r1 runs at {restarted.budget_in_force_w('r1'):.0f} W, "
        f"above the operator's {kept.budget_in_force_w('r1'):.0f} W cut "
        f"(overrides now: {sorted(restarted.overrides.budgets)})"
    )
