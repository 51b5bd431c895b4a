"""Worker processes that end with the process that started them.

A real run's rank processes and a sweep's pool workers are children of one driver process. If that process is
killed (SIGKILL, or SIGTERM, whose default action skips every ``atexit`` and ``finally``), its children would keep
running — holding GPUs, or burning CPU on points nobody reads. :func:`die_with_parent`, called first thing in such a
child, ties its life to its parent's: on Linux the kernel sends it SIGKILL when the parent dies
(``prctl(PR_SET_PDEATHSIG)``); on every platform a daemon thread also checks once a ``poll_s`` that the parent is
still the one it started with and exits the process if not (this covers the moment between the fork and the
``prctl`` call, and platforms without ``prctl``).

Two parents can differ. A ``multiprocessing`` child started with ``forkserver`` is forked by the fork server, not
by the process that asked for it: its operating-system parent (``os.getppid()``) is the fork server, its
``multiprocessing`` parent (``mp.parent_process()``) the asking process. The kernel signal follows the former (the
fork server itself exits when the process that started it does, so the chain holds); the watch thread checks both
— the parent it had when it started, and that the ``multiprocessing`` parent is still alive. (Taking the asking
process for the operating-system parent made every forkserver worker exit at once.)
"""

from __future__ import annotations

import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1


def _prctl_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def die_with_parent(parent_pid: int | None = None, poll_s: float = 1.0) -> None:
    """Make this process exit when its parent does (module docstring). ``parent_pid``: the process whose death ends
    this one (default: the process that started it, for a ``multiprocessing`` child, else the current parent)."""
    os_parent = os.getppid()
    if parent_pid is None:
        import multiprocessing as mp

        started_by = mp.parent_process()
        parent_pid = started_by.pid if started_by is not None else os_parent
    owner = parent_pid
    _prctl_pdeathsig(signal.SIGKILL)
    if os.getppid() != os_parent or not _alive(owner):  # a parent died before the prctl
        os._exit(1)

    def watch() -> None:
        ev = threading.Event()
        while not ev.wait(poll_s):
            if os.getppid() != os_parent or not _alive(owner):
                os._exit(1)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()
