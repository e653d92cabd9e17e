"""Where the servers and the trainer's channel are: server lists (URLs, ``host:port`` lists
and SLURM node lists) to base URLs, this host's address on the route to them, free
ports, the channel's backend."""

from __future__ import annotations

import re
import socket
import urllib.parse
from collections import Counter
from collections.abc import Iterable, Mapping

import torch

from hotweights.errors import ConfigError, RemoteError
from hotweights.protocol.urls import server_url

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
    with commas, or a list: of a mapping, its keys), each with or without ``http://`` or
    ``https://``: ``"https://gpu[01-04]:8443"``. Without a scheme a server is http and one
    without a port gets `port`; with one (a URL), its scheme's (80, 443), as any URL.

    Raises:
        ConfigError: an empty list, a server named twice, an unreadable node list, a URL
            that is not a server's (`urls.server_url`).
    """
    if isinstance(servers, str):
        items = _split(servers)
    elif isinstance(servers, Iterable) and not isinstance(servers, bytes):
        items = list(servers)
    else:
        raise ConfigError(f"servers: a str or a list of str, found {servers!r}")
    if bad := [s for s in items if not isinstance(s, str)]:
        raise ConfigError(f"servers: each a URL, host[:port] or node list (a str), found "
                          f"{bad[0]!r}")
    urls = []
    for item in filter(None, (s.strip() for s in items)):
        scheme, sep, rest = item.partition("://")
        if not sep:
            scheme, rest = "http", item
            if rest.startswith("["):  # an IPv6 literal: [::1] or [::1]:8000
                rest = rest.rstrip("/")
                urls.append(server_url(f"http://{rest}" + ("" if "]:" in rest else
                                                           f":{port}")))
                continue
        elif not re.match(r"[^/\[]+\[", rest):  # a URL, not a node list
            urls.append(server_url(item))
            continue
        at = rest.rfind("]") + 1  # past a node list's last bracket: its port and path follow
        tail, _, path = rest[at:].partition("/")
        host, _, given = (rest[:at] + tail).partition(":")
        given = given or ("" if sep else str(port))
        urls += [server_url(f"{scheme}://{h}" + (f":{given}" if given else "") +
                            (f"/{path}" if path else "")) for h in expand_nodes(host)]
    if not urls:
        raise ConfigError(f"no servers in {servers!r}")
    if dupes := sorted(u for u, n in Counter(urls).items() if n > 1):
        raise ConfigError(f"servers named twice: {', '.join(dupes)}")
    return urls


def channel_backend(status: Mapping[str, dict]) -> str:
    """The backend of a channel to the servers of `status` (url -> status): NCCL where their
    workers hold the weights on CUDA devices (this process needs one too), Gloo where on
    the CPU."""
    devices = {u: st.get("device", "cpu") for u, st in status.items()}
    if len(set(devices.values())) > 1:
        raise RemoteError(f"the servers' workers are on different kinds of device ({devices}): "
                          "one channel carries CUDA or CPU tensors, not both; use one "
                          "RemoteGroup per kind")
    if (kind := next(iter(devices.values()))) not in ("cpu", "cuda"):
        raise RemoteError(f"{next(iter(devices))}: workers on '{kind}' devices: a channel "
                          "carries CUDA (NCCL) or CPU (Gloo) tensors only")
    if kind == "cuda" and not torch.cuda.is_available():
        raise RemoteError(f"the servers' workers hold the weights on CUDA devices "
                          f"({sorted(devices)}): their channel is NCCL, which needs a CUDA "
                          "device in this process too (none is visible here)")
    return "nccl" if kind == "cuda" else "gloo"


def route_address(url: str) -> str:
    """This host's address on the route to the server at `url` (what the kernel would send
    from; nothing is sent). `gethostbyname(gethostname())` is 127.0.1.1 on Debian/Ubuntu,
    which no other machine reaches."""
    parts = urllib.parse.urlsplit(url)
    try:
        family, _, _, _, addr = socket.getaddrinfo(parts.hostname, parts.port or 80,
                                                   type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except OSError as e:
        raise RemoteError(f"{url}: no route to its host from here ({e}); pass "
                          "RemoteGroup(master_addr=) an address of this host the servers "
                          "reach") from e


def free_port(addr: str, port: int = 0) -> int:
    """`port` (any free one for 0) if it can be bound on `addr` (IPv4 or IPv6) now, else 0."""
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        try:
            s.bind((addr, port))
        except OSError:
            return 0
        return s.getsockname()[1]
