"""Sessions that survive the loss of their proxy: ``connect(url, failover=...)``.

A ``FailoverSession`` stands where a ``ClientSession`` stands under both front ends (the
session contract, ``gpuremote.session.contract.Session``), over the session it currently
uses. It keeps what it needs to rebuild the session's state on another proxy, in four parts:

- the **ledger** (``ledger``): the journal of every call since the last checkpoint, in order,
  with its host data, and the state of every buffer (live, written since the checkpoint,
  known to the client from its upload); pure, no I/O;
- the **checkpoints** (``checkpoint``): every buffer written since the last one copied where
  it costs least (to a standby proxy, proxy to proxy; else into the client; an upload's own
  bytes need no copy), at one point of the session's command order, every
  ``checkpoint_interval_s`` and when the journal reaches its bound;
- the **standby** (``standby``): a session on another proxy holding the checkpoint's copies;
- the **move** (``move``): when the proxy is lost (the connection closes, or no reply comes
  within ``call_timeout_s``), the session moves to the standby, else to another proxy (the
  pool places one; else the next URL of the list), where the checkpoint is restored; then
  the journal is re-issued: what the lost proxy had confirmed is re-run (its replies
  dropped) and what it had not is sent and answered as if nothing had happened.

The application sees a pause, a log line (logger ``gpuremote.failover``) and ``failovers`` in
``stats()``; its arrays, streams and recorded steps are where they were. Exactly once: the
restored buffers plus the re-run journal give the state an uninterrupted run would have (the
backends compute deterministically); a synchronising call whose answer carried a deferred
error is re-run as a plain synchronisation, its answer dropped, so that the error is raised
once. What cannot be restored (``docs/reference/failover.md``) raises ``FailoverError`` (a
``ConnectionClosed``) at the next synchronising call, naming it.
"""

from ...errors import FailoverError
from .config import FailoverConfig, FailoverCounters, failover_config
from .session import FailoverSession, open_failover_session

__all__ = [
    "FailoverConfig",
    "FailoverCounters",
    "FailoverError",
    "FailoverSession",
    "failover_config",
    "open_failover_session",
]
