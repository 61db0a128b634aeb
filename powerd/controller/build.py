"""One place that builds a `Controller`: its tick engine (solver, shadow, authority, scope),
its ledger (store, state file, the operators' state found at start) and its lease, wired.

The daemon (main.py) reads its settings, the policy file, the state file and the database
first, then calls `build_controller` with what it found; tests, the demo and the benchmarks
call it with less. What a caller adds afterwards is its own: the per-tick hooks (`on_tick`,
`on_round`: metrics, watchdog) and the tasks that run the parts.
"""

from __future__ import annotations

from powerd.clock import Clock
from powerd.controller.controller import Controller, ControllerOptions, StartState
from powerd.controller.leadership import Leadership
from powerd.controller.opstate import StateFile
from powerd.controller.scope import ScopeLink
from powerd.controller.tick import TickEngine
from powerd.policy import Policy, failsafe_budget_w
from powerd.store import Store, StoreWriter
from powerd.transport import Transport
from powerd.wire import Authority

__all__ = ["ControllerOptions", "StartState", "build_controller"]

_DEFAULTS = ControllerOptions()
_FRESH = StartState()


def build_controller(
    policy: Policy,
    transport: Transport,
    clock: Clock,
    options: ControllerOptions = _DEFAULTS,
    *,
    store: Store | None = None,
    writer: StoreWriter | None = None,
    state_file: StateFile | None = None,
    authority: Authority | None = None,
    leadership: Leadership | None = None,
    start: StartState = _FRESH,
) -> Controller:
    """A controller steering `policy`, ready to `run`.

    `store`: the database it reads and its ledger writes the operators' state and audit
    rows to; `writer`: the thread that records what it steers; `state_file`: where its
    ledger keeps the operators' state (a shadow, `options.shadow`, gets neither ledger
    store nor state file). `authority`: whom its commands are for (None: the empty one).
    `leadership`: the lease it commands under (None: it always may), which follows the
    operators' state and the policy of record through this controller's ledger. ScopeError
    if `options.scope` is not a row or rack of the policy."""
    engine = TickEngine(policy, solver=options.solver, shadow=options.shadow)
    engine.obedience.authority = authority
    link = None
    if options.scope is not None:
        engine.set_scope(options.scope)
        link = ScopeLink(
            options.scope,
            failsafe_budget_w(policy, options.scope),
            lease_s=policy.control.lease_s,
            started_at=clock.monotonic(),
        )
    controller = Controller(
        engine,
        transport,
        clock,
        options,
        store=store,
        writer=writer,
        state_file=state_file,
        scope=link,
        leadership=leadership,
        start=start,
    )
    if leadership is not None:
        leadership.follow = controller.ledger.follow
        leadership.each_round = controller.ledger.follow_policy
        leadership.handing_to = controller.handing_to
    return controller
