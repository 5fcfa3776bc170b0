"""What each call does on the proxy: one handler per call of the call table, in one table
(``HANDLERS``), checked when it is imported: every call that crosses the wire has a handler,
and there is no handler for anything else; the session's admin calls (``admin``) are apart
from the device work (``memory``, ``launches``, ``streams``, ``steps``, ``peers``, ``aten``,
``collectives``).

A handler is called as ``handler(state, ctx, *args)``: the session's ``SessionState``, the
``BatchContext`` of the command's batch, and the call's decoded arguments; it returns the
call's answer (for calls that have one) and raises to fail it.
"""

from __future__ import annotations

from ...wire.calls import CALLS, CallClass
from ..state import Handler
from . import admin, aten, collectives, launches, memory, peers, steps, streams

__all__ = ["HANDLERS", "Handler"]

#: call name -> its handler
HANDLERS: dict[str, Handler] = {
    **admin.HANDLERS,
    **memory.HANDLERS,
    **launches.HANDLERS,
    **streams.HANDLERS,
    **steps.HANDLERS,
    **peers.HANDLERS,
    **aten.HANDLERS,
    **collectives.HANDLERS,
}


def _check() -> None:
    """Every call on the wire has one handler, nothing else has one, and the admin calls'
    are the admin module's."""
    wire = {c.name for c in CALLS if c.klass is not CallClass.LOCAL}
    admin_calls = {c.name for c in CALLS if c.admin}
    modules = (memory, launches, streams, steps, peers, admin, aten, collectives)
    if sum(len(m.HANDLERS) for m in modules) != len(HANDLERS):
        raise RuntimeError("two handlers for one call")
    if HANDLERS.keys() != wire:
        raise RuntimeError(
            f"calls without a handler: {sorted(wire - HANDLERS.keys())}; "
            f"handlers of no call: {sorted(HANDLERS.keys() - wire)}"
        )
    if admin.HANDLERS.keys() != admin_calls:
        raise RuntimeError("the admin calls' handlers are the admin module's, and only theirs")


_check()
