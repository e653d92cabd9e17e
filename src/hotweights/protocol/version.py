"""Weight versions as the wire carries them: `N@SERVER`, in every response's header.

N counts the weight states one server start has served; SERVER is random per start, so no
two weight states share a version, across restarts too.
"""

from __future__ import annotations

import re

from hotweights.errors import HotweightsError

VERSION_HEADER = "x-hotweights-version"  # on every response of a hotweights server
_LABEL = re.compile(r"([0-9]+)@([0-9A-Za-z_-]+)")  # ASCII digits; SERVER a word, no space


def parse_version(label: str) -> tuple[int, str]:
    """`"7@3f9a1c2b"` -> (7, "3f9a1c2b"); a HotweightsError names a malformed label."""
    found = _LABEL.fullmatch(label) if isinstance(label, str) else None
    if found is None:
        raise HotweightsError(f"weight version {label!r}: expected N@SERVER, e.g. 7@3f9a1c2b")
    return int(found[1]), found[2]
