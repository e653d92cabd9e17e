"""Benchmarks that survive the machine: a part that cannot run here is named with why.

A baseline or a model that dies on some CPU (vLLM's AMX MoE kernel on an AVX-512 BF16 +
AMX CPU: its worker is killed by SIGILL, exit -4, and the server exits) must not take the
whole benchmark down: the benchmark records the part as skipped, prints one line on stderr
and goes on, and its last stdout line (JSON) carries `"skipped": {name: reason}`.
"""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# A negative exit code as vLLM and `launch.wait_ready` print them: "exit code: -4",
# "exited with -4", "died with exit code -4", "Failed core proc(s): {'EngineCore_DP0': -4}".
_EXIT = re.compile(r"(?:exit code:?|exited with|': )\s*(-\d+)\b")
_WHY = {signal.SIGILL: "illegal instruction: a kernel this CPU cannot run",
        signal.SIGSEGV: "segmentation fault", signal.SIGBUS: "bus error",
        signal.SIGKILL: "killed: out of memory?", signal.SIGABRT: "aborted"}


def died_of(returncode: int) -> str:
    """`returncode` of a process in words: "exit 1", "SIGILL (illegal instruction: ...)"."""
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        sig = signal.Signals(-returncode)
    except ValueError:
        return f"exit {returncode}"
    why = _WHY.get(sig)
    return f"{sig.name} ({why})" if why else sig.name


def crash(text: str) -> str | None:
    """The signal that some process in `text` (a server's log, a child's stderr) died of,
    in words; None when `text` shows none."""
    for m in _EXIT.finditer(text):
        if (said := died_of(int(m.group(1)))).startswith("SIG"):
            return f"a process died of {said}"
    if "Illegal instruction" in text:  # the shell's or faulthandler's words for SIGILL
        return f"a process died of {died_of(-signal.SIGILL)}"
    return None


def reason(exc: BaseException, log: Path | None = None) -> str:
    """One line: what `exc` says first, which signal killed a process if `exc` or the tail
    of `log` tells, and where `log` is (when it exists and `exc` does not name it)."""
    text = str(exc)
    first = text.strip().splitlines()[0].rstrip(":") if text.strip() else ""
    out = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    tail = ""
    if log is not None:
        try:
            tail = log.read_text(errors="replace")[-20000:]
        except OSError:
            pass
    signalled = crash(text) or crash(tail)
    out = f"{out}; {signalled}" if signalled else out
    if log is None or not log.exists() or str(log) in first:
        return out
    return f"{out} (log: {log})"


class Skips:
    """The parts of one benchmark run that could not run here, by name, with why."""

    def __init__(self) -> None:
        self.reasons: dict[str, str] = {}

    def add(self, name: str, why: str) -> None:
        self.reasons[name] = why
        print(f"skipped {name}: {why}", file=sys.stderr, flush=True)

    def attempt(self, name: str, fn: Callable[..., T], *args, log: Path | None = None,
                **kwargs) -> T | None:
        """`fn(*args, **kwargs)`, or None when it raised: then `name` is skipped with the
        reason (`log`, a server's log, is searched for the signal that killed it)."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - named and reported; the benchmark goes on
            self.add(name, reason(e, log))
            return None

    def __contains__(self, name: str) -> bool:
        return name in self.reasons

    def __bool__(self) -> bool:
        return bool(self.reasons)
