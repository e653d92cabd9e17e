"""A process on this machine, told apart from a later one that reuses its pid by its start
time (Linux `/proc`; elsewhere unknown): how a server sees that the trainer holding its
update lease exited."""

from __future__ import annotations


def start_time(pid: int | str = "self") -> int:
    """When the process started, in clock ticks since boot; 0 where unknown (not Linux,
    no such process, one that exited and is not yet reaped, a `/proc` that hides it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()  # after the name, which may hold spaces
        return 0 if fields[0] in (b"Z", b"X") else int(fields[19])  # state, starttime
    except (OSError, ValueError, IndexError):
        return 0


def alive(pid: int, start: int) -> bool:
    """Whether process `pid`, started at `start` (`start_time`), still runs."""
    return start != 0 and start_time(pid) == start
