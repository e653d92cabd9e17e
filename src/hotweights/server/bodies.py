"""The bodies of the update routes (begin, renew, commit, receive, abort): frozen dataclasses
built from JSON, validated; a bad field is a `Refused` (400) that names it."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from hotweights.errors import HotweightsError
from hotweights.protocol.renewer import MAX_LEASE_S

__all__ = ["DEFAULT_LEASE_S", "MAX_LEASE_S", "MODES", "Abort", "Begin", "Body", "Commit",
           "Receive", "Refused", "Renew"]

MODES = ("wait", "abort", "keep")
DEFAULT_LEASE_S = 60.0


class Refused(HotweightsError):
    """A request the transaction refuses; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, **detail: Any):
        super().__init__(message)
        self.status, self.detail = status, detail

    def to_dict(self) -> dict:
        return {"error": str(self), **self.detail}


_KINDS = {"str": str, "float": float, "bool": bool, "int": int}


@dataclass(frozen=True)
class Body:
    """What every route's body holds: who asks (`holder`) and which server start it mapped
    (`server_id`); and, from a holder that numbers its updates, which one it is of (`seq`,
    rising: a request of an earlier update that arrives late is refused; 0: unnumbered)."""

    holder: str
    server_id: str
    seq: int = field(default=0, kw_only=True)  # (not positional: the subclasses' fields are)

    def __post_init__(self) -> None:
        for name in ("holder", "server_id"):
            if not 0 < len(value := getattr(self, name)) <= 200:
                raise Refused(400, f"field {name!r} must be 1 to 200 characters, got {value!r}")
        if not 0 <= self.seq < 2**53:
            raise Refused(400, f"field 'seq' must be in [0, 2**53), got "
                          f"{self.seq if abs(self.seq) < 10**20 else 'a larger number'}")
        lease_s = getattr(self, "lease_s", DEFAULT_LEASE_S)
        if not 0 < lease_s <= MAX_LEASE_S:  # also refuses nan and inf
            raise Refused(400, f"field 'lease_s' must be in (0, {MAX_LEASE_S:.0f}] seconds, "
                          f"got {lease_s!r}")
        if getattr(self, "mode", "wait") not in MODES:
            raise Refused(400, f"field 'mode' must be one of {MODES}, got {self.mode!r}")

    @classmethod
    def from_json(cls, data: object):
        """Build from a JSON body; Refused(400) names a missing, unknown or mistyped field."""
        if not isinstance(data, dict):
            raise Refused(400, f"expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(data) - known):
            raise Refused(400, f"unknown field(s) {unknown}; known: {sorted(known)}")
        values = {}
        for f in fields(cls):
            if f.name not in data:
                if f.default is MISSING:
                    raise Refused(400, f"field {f.name!r} is required")
                continue
            value, kind = data[f.name], _KINDS[f.type]
            if kind is float and type(value) is int:
                try:
                    value = float(value)
                except OverflowError:  # hundreds of digits
                    raise Refused(400, f"field {f.name!r} is out of range, got a number of "
                                  f"{len(str(value))} digits") from None
            if type(value) is not kind:  # bool is not taken for a number, nor 1 for a bool
                raise Refused(400, f"field {f.name!r} must be a {kind.__name__}, "
                              f"got {value!r}")
            values[f.name] = value
        return cls(**values)


@dataclass(frozen=True)
class Begin(Body):
    mode: str = "wait"
    lease_s: float = DEFAULT_LEASE_S
    stage: bool = False  # lease without pausing: the commit pauses (remote servers)
    read: bool = False  # the holder only reads the weights (a checkpoint): its lease ends
    #                     clean, at the same version, however it ends; it cannot commit
    process: str = ""  # the holder's process (`protocol.process.identity`): where it runs
    #                    beside this server, the lease ends once it exits

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.process) > 200:
            raise Refused(400, f"field 'process' must be at most 200 characters, got "
                          f"{self.process[:40]!r}...")


@dataclass(frozen=True)
class Renew(Body):
    lease_s: float = DEFAULT_LEASE_S
    pause: bool = False  # a staged update: start the commit's pause now (its last round is
    #                      on its way), so that the commit need not wait for the step in flight


@dataclass(frozen=True)
class Commit(Body):
    n: int = 0  # the version number to serve: 0 for the next; a trainer of many servers
    #             gives them all the same one (it must be above the current)
    next_update: str = ""  # a remote server: the id of the trainer's next update on its
    #                        channel, which the workers then wait for (`Receive` needs no
    #                        engine request for it)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.n < 2**53:  # (a metric, a float, reads it exactly)
            raise Refused(400, f"field 'n' must be a version number (>= 0, below 2**53; 0: "
                          f"the next), got {self.n if abs(self.n) < 10**20 else 'a larger one'}")
        if len(self.next_update) > 200:
            raise Refused(400, f"field 'next_update' must be at most 200 characters, got "
                          f"{self.next_update[:40]!r}...")


@dataclass(frozen=True)
class Receive(Body):
    """A remote server's receive step, under the holder's lease: with `update`, its workers
    wait up to `wait_s` for the trainer to start that update on the channel."""

    update: str = ""
    wait_s: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.wait_s <= MAX_LEASE_S:
            raise Refused(400, f"field 'wait_s' must be in [0, {MAX_LEASE_S:.0f}] seconds, "
                          f"got {self.wait_s!r}")
        if len(self.update) > 200:
            raise Refused(400, f"field 'update' must be at most 200 characters, got "
                          f"{self.update[:40]!r}...")


@dataclass(frozen=True)
class Abort(Body):
    dirty: bool = True  # the trainer may have written part of an update
