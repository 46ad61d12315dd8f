"""No process of a command run under a lock outlives the lock (docs/guarantees.md,
"Commands run under a lock").

``pgleaderlock exec``, ``exec -n``, ``cron`` and the Django singleton command run work
for the lock's holder. When the holder ends (a release, a lost session, SIGKILL, the
OOM killer), the server frees the lock as soon as it sees the session's socket close,
and the next leader's command starts milliseconds later, on this host or another. So
every process of the last command's tree must be gone *before* that socket closes.

The order comes from a second process, the keeper
([`keeper`][pgleaderlock.proctree.keeper]): it holds a duplicate of the session's
socket (a ``dup`` of the descriptor; the server sees the connection close only when the
last one is closed), answers for the command's processes, and exits only once they are
all gone. If the holder dies, the end of the pipe it gave orders on tells the keeper,
which SIGKILLs everything and waits until it is gone before it exits.

The server may also end the session first (a terminated backend, a restart): the lock
is free at once. A leader on the same host still waits, for the host's own lock
([`hostlock`][pgleaderlock.proctree.hostlock]), which the keeper and the command's
processes hold until they end.

- [`tree`][pgleaderlock.proctree.tree]: ``exec`` and ``cron`` (COMMAND is the keeper's
  child; on Linux the keeper is its subreaper, so no descendant escapes it);
- [`marked`][pgleaderlock.proctree.marked]: the Django singleton command (the command
  runs in the holder's own process; the processes it starts carry a mark).
"""

from __future__ import annotations
