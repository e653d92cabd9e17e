"""Server lists: URLs, ``host:port`` lists and SLURM node lists, to base URLs."""

from __future__ import annotations

import re
from collections.abc import Iterable

from hotweights.errors import ConfigError

DEFAULT_PORT = 8000
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split(text: str) -> list[str]:
    """Split on commas outside brackets: "a[1-3,5],b" -> ["a[1-3,5]", "b"]."""
    out, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    return [*out, text[start:]]


def expand_nodes(spec: str) -> list[str]:
    """A SLURM node list to host names: ``"gpu[01-03,07],cpu1"`` -> gpu01 gpu02 gpu03 gpu07
    cpu1 (zero padding kept; one bracket per name)."""
    hosts = []
    for part in filter(None, (p.strip() for p in _split(spec))):
        m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", part)
        if m is None:
            if "[" in part or "]" in part:
                raise ConfigError(f"node list {spec!r}: cannot read {part!r}")
            hosts.append(part)
            continue
        head, ranges, tail = m.groups()
        for r in ranges.split(","):
            rm = _RANGE.match(r.strip())
            if rm is None:
                raise ConfigError(f"node list {spec!r}: {r!r} is not N or N-M")
            lo, hi = rm.group(1), rm.group(2) or rm.group(1)
            if int(hi) < int(lo):
                raise ConfigError(f"node list {spec!r}: range {r!r} runs backwards")
            hosts += [f"{head}{i:0{len(lo)}d}{tail}" for i in range(int(lo), int(hi) + 1)]
    return hosts


def server_urls(servers: str | Iterable[str], port: int = DEFAULT_PORT) -> list[str]:
    """Base URLs of servers given as URLs, ``host[:port]`` or SLURM node lists (a string
    with commas, or a list); a host without a port gets `port`.

    Raises:
        ConfigError: an empty list, a server named twice, an unreadable node list.
    """
    items = _split(servers) if isinstance(servers, str) else list(servers)
    urls = []
    for item in filter(None, (s.strip() for s in items)):
        if "://" in item:
            urls.append(item.rstrip("/"))
            continue
        host, _, given = item.partition(":") if "[" not in item else (item, "", "")
        if "[" in item and (m := re.fullmatch(r"(.*\])(?::(\d+))?", item)):
            host, given = m.group(1), m.group(2) or ""
        urls += [f"http://{h}:{given or port}" for h in expand_nodes(host)]
    if not urls:
        raise ConfigError(f"no servers in {servers!r}")
    if dupes := sorted({u for u in urls if urls.count(u) > 1}):
        raise ConfigError(f"servers named twice: {', '.join(dupes)}")
    return urls
