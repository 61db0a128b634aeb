"""Attack: a controller that starts without its state file while the database is down
numbers its operators' state from 0 again; the database silently keeps the old revisions,
and the next restart resurrects a state the operators had replaced.

What breaks: `Ledger.start_from` takes revision = max(database's, file's); with the state
file gone (moved aside as unreadable, a new disk, a changed `--state-file`) and the
database unreachable at start, that is 0. When the database returns, the new revisions 1,
2, ... collide with the old ones and `save_operator_state` (ON CONFLICT DO NOTHING) drops
them without an error: the sync reports success, `durable`/`audited` answer true. At the
next start `_newer` prefers the database's higher revision: the old state.

Sequence: controller A: drain r2-n2, cut dc to 4,000 W, cut r1 to 3,000 W (revisions 1-3,
in the file and the database). The state file is lost and the database is down when B
starts: B starts clean (alarmed). The database returns; B's operators set what they want
now (dc 5,000 W, r2 3,700 W): revisions 1-2, both answered durable and audited. Restart C:
the database's revision 3 (A's) beats the file's 2 (B's): r2-n2 is drained again, dc and
r1 are back at A's cuts, B's r2 cut is gone.

Observed: C restored ({'dc': 4000.0, 'r1': 3000.0}, ['r2-n2']) from revision 3; B had left
({'dc': 5000.0, 'r2': 3700.0}, []).

Why it matters: a restart silently rolls operators' state back to an older one, while
every answer since said "durable: true". Fix: make revisions unique per write (ULID /
timestamp, or read the database's latest revision when it returns and renumber above it),
and treat a conflicting revision as an error, not a success.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.honest import policy_dict

from powerd.clock import ManualClock
from powerd.controller.build import build_controller
from powerd.controller.controller import Controller
from powerd.controller.main import _newer
from powerd.controller.opstate import OperatorState, StateFile, restore
from powerd.policy import parse_policy
from powerd.store import Store, upgrade
from powerd.transport import MemoryBroker


@pytest.mark.asyncio
async def test_a_start_without_file_and_database_reuses_revisions_and_loses_them(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'powerd.db'}"
    upgrade(url)
    store = Store(url)
    clock = ManualClock(start=1_000.0)
    policy = parse_policy(policy_dict())

    def controller(state_file: StateFile) -> Controller:
        return build_controller(
            policy, MemoryBroker().client("c"), clock, store=store, state_file=state_file
        )

    a = controller(StateFile(tmp_path / "a" / "state.json"))
    await a.ledger.commit(lambda: a.drain("r2-n2", actor="ops", reason="PSU"), lowers_power=True)
    await a.ledger.commit(
        lambda: a.set_budget("dc", 4000, expires_at=None, actor="grid", reason="DR"),
        lowers_power=True,
    )
    await a.ledger.commit(
        lambda: a.set_budget("r1", 3000, expires_at=None, actor="ops", reason="breaker"),
        lowers_power=True,
    )
    await a.ledger.flush(5)
    assert a.ledger.db_revision == 3

    # The state file is lost and the database is down when B starts.
    b_file = StateFile(tmp_path / "b" / "state.json")
    b = controller(b_file)
    b.ledger.start_from(None, db_revision=0, file_revision=0)
    # The database is back; B's operators set what they want now.
    out1 = await b.ledger.commit(
        lambda: b.set_budget("dc", 5000, expires_at=None, actor="grid", reason="DR-2"),
        lowers_power=True,
    )
    out2 = await b.ledger.commit(
        lambda: b.set_budget("r2", 3700, expires_at=None, actor="ops", reason="fans"),
        lowers_power=True,
    )
    await b.ledger.flush(5)
    assert out1.durable and out1.audited and out2.durable and out2.audited

    # Restart C: main.py takes the newer of the state file and the database.
    row = store.latest_operator_state()
    assert row is not None
    db_state = OperatorState.model_validate(row.state | {"revision": row.revision})
    chosen = _newer(b_file.load(), db_state)
    assert chosen is not None
    c_overrides = restore(chosen, policy, clock.wall())
    got = ({k: v.budget_w for k, v in c_overrides.budgets.items()}, sorted(c_overrides.drained))
    want = ({k: v.budget_w for k, v in b.overrides.budgets.items()}, sorted(b.overrides.drained))
    assert got == want, f"restart restored {got} (revision {chosen.revision}); B had left {want}"
