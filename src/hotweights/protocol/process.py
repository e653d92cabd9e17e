"""A process on this machine, named so that another machine, another pid namespace or a
later process that reuses its pid is not taken for it: how a server sees that the
trainer holding its update lease exited (Linux `/proc`; elsewhere not watched)."""

from __future__ import annotations

import os
from collections.abc import Callable


def identity() -> str:
    """This process as `watch` reads it (`BOOT:PIDNS:PID:START`: the kernel's boot id, the
    inode of its pid namespace, its pid and its start in clock ticks since boot); "" where
    `/proc` does not say."""
    try:
        start = _start(os.getpid())
        return f"{_here()}:{os.getpid()}:{start}" if start else ""
    except (OSError, ValueError, IndexError):
        return ""


def watch(ident: str) -> Callable[[], bool] | None:
    """A probe that says whether the process `ident` (`identity`) names has exited; None
    where it cannot be watched from this process: another boot (machine) or pid
    namespace, no such process running, or no `/proc`."""
    try:
        here, pid, start = ident.rsplit(":", 2)
        pid, start = int(pid), int(start)
        if here != _here() or pid <= 0 or start <= 0 or _start(pid) != start:
            return None
    except (OSError, ValueError, IndexError):
        return None

    def exited() -> bool:
        """Surely exited: its `/proc` entry gone, a zombie whose threads all ended, or
        another process under its pid. An error reading `/proc` (a full descriptor table,
        no memory) is not taken for an exit."""
        try:
            return _start(pid) != start
        except FileNotFoundError:
            return True
        except (OSError, ValueError, IndexError):
            return False

    return exited


def _here() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f"{f.read().strip()}:{os.stat('/proc/self/ns/pid').st_ino}"


def _start(pid: int) -> int:
    """The start of process `pid` in clock ticks since boot; 0 once it exited (a zombie,
    not yet reaped, whose other threads ended too). Raises OSError."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2:].split()  # after its name, which may hold spaces
    if fields[0] in (b"Z", b"X") and len(os.listdir(f"/proc/{pid}/task")) <= 1:
        return 0  # (a zombie leader whose threads run on is alive)
    return int(fields[19])  # starttime, the 22nd field
