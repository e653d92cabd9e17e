"""`hotweights status [URL]`: a server's weight version and update state, for humans."""

from __future__ import annotations

import argparse
import json
import time

from hotweights.protocol.http import server_status
from hotweights.protocol.urls import server_url

_STATES = {
    "idle": "serving",
    "draining": "holding new requests while in-flight ones finish (update starting)",
    "paused": "paused for an update",
    "staging": "serving while a remote update is staged (the lease is held)",
    "committing": "committing an update",
    "expired": "serving; the last update's lease expired",
}


STATUS_TIMEOUT_S = 15  # a server answers its status at once, even mid-update


def rows(status: dict, now: float) -> list[tuple[str, str]]:
    """What `status` prints, line by line (a status of any state, any server version)."""
    lease, left = status.get("lease_expires"), status.get("lease_left_s")
    if isinstance(lease, int | float) and not isinstance(left, int | float):
        left = lease - now  # a server before lease_left_s: by this machine's clock
    holder, state, versions = (status.get(k) for k in ("holder", "state", "dirty_versions"))
    out = [
        ("weight version", str(status["version"])),
        ("state", _STATES.get(state, state) if isinstance(state, str)
         else "unknown" if state is None else str(state)),
        ("lease", "none" if holder is None else
         f"{holder} ({status.get('mode')})" + (
             f", expires in {max(0.0, left):.0f} s" if isinstance(left, int | float) else "")),
    ]
    if status.get("dirty"):
        out.append(("weights", f"DIRTY: {status.get('dirty_reason') or 'update interrupted'}; "
                    "the next clean commit clears it"))
    else:
        out.append(("weights", "clean"))
    if versions:
        out.append(("dirty versions", ", ".join(map(str, versions)) if isinstance(versions, list)
                    else str(versions)))
    if isinstance(expired := status.get("expired"), dict):  # the last lease that ended
        ago = expired.get("ago_s")  # unasked: ran out, or its holder's process exited
        if not isinstance(ago, int | float) and isinstance(at := expired.get("at"), int | float):
            ago = now - at  # a server before ago_s: by this machine's clock
        out.append(("lease ended", str(expired.get("why") or f"lease of "
                                       f"{expired.get('holder')} expired") + (
            f", {max(0.0, ago):.0f} s ago" if isinstance(ago, int | float) else "")))
    out.append(("updates", str(status.get("updates", 0))))
    for key, label in _TIMINGS:
        if isinstance(status.get(key), int | float):
            out.append((label, f"{1e3 * status[key]:.1f} ms"))
    if status.get("armed"):
        out.append(("remote", "armed: the workers wait for the trainer's next update"))
    return out


_TIMINGS = (  # the last update's, from the server's clock
    ("last_pause_s", "to pause"),  # begin (or the staged commit) until generation paused
    ("last_paused_s", "paused"),  # generation paused: pause to resume (an update's, or a
    # reader's: `sync --server` holds it while it reads)
    ("last_commit_s", "commit"),
    ("last_update_s", "update"),  # begin to the end of the commit
)


def run(args: argparse.Namespace) -> int:
    url = server_url(args.url)
    status = server_status(url, args.token, cafile=args.cafile, timeout=STATUS_TIMEOUT_S)
    if args.json:
        print(json.dumps(status))
        return 0
    print(url)
    for key, value in rows(status, time.time()):
        print(f"  {key:<15}{value}")
    return 0
