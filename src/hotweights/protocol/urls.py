"""A hotweights server's base URL, checked before anything is sent to it."""

from __future__ import annotations

import contextlib
import ipaddress
import urllib.parse

from hotweights.errors import ConfigError

SCHEMES = ("http", "https")


def is_loopback(host: str | None) -> bool:
    """Whether `host` names this machine through the loopback interface only."""
    if not host:
        return False
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_url(url: str) -> str:
    """`url` without its trailing slash, once it reads as a server's base URL: http or
    https, a host, a port from 1 to 65535 if one is given.

    Raises:
        ConfigError: anything else, naming the URL and what is wrong with it.
    """
    def bad(why: str) -> ConfigError:
        return ConfigError(f"{url!r} is not a server URL: {why} "
                           "(expected http://HOST:PORT or https://HOST:PORT)")

    if not isinstance(url, str):
        raise bad(f"a {type(url).__name__}, not a str")
    if "@" in url.split("://", 1)[-1].split("/", 1)[0]:  # before any message shows the URL
        raise ConfigError("a server URL with a user or password in it (USER:PASSWORD@) is "
                          "not one: the server's token is its only credential")
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port
    except ValueError as e:  # a port out of range or not a number, an unclosed [IPv6
        raise bad(str(e)[:1].lower() + str(e)[1:]) from None
    if "://" not in url:
        raise bad(f"no http:// or https:// (http://{url.strip()}?)")
    if parts.scheme not in SCHEMES:
        raise bad(f"the scheme is {parts.scheme!r}")
    if not parts.hostname:
        raise bad("no host")
    if port == 0:
        raise bad("port 0")
    if parts.query or parts.fragment:
        raise bad("a query or fragment after it (the routes follow its path)")
    if any(c.isspace() or not c.isprintable() for c in url.strip()):
        raise bad("a space or control character in it")
    return url.strip().rstrip("/")


_LOOPBACK = ("localhost", "127.0.0.1", "::1")  # this machine, by its names


def port_of(parts: urllib.parse.SplitResult) -> int:
    """The port of a split server URL, its scheme's where none is given."""
    return parts.port or (443 if parts.scheme == "https" else 80)


def same_server(a: str, b: str) -> bool:
    """Whether the server URLs `a` and `b` name one server: the same scheme, port and path,
    and the same host, spelled alike in any case, or this machine's loopback address by
    two of its names (`localhost`, 127.0.0.1, [::1]: a server on all of them listens on
    0.0.0.0 or ::). No name is looked up."""
    def key(url: str) -> tuple:
        parts = urllib.parse.urlsplit(server_url(url))
        host = (parts.hostname or "").rstrip(".")
        with contextlib.suppress(ValueError):
            address = ipaddress.ip_address(host)
            host = str(getattr(address, "ipv4_mapped", None) or address)
        return (parts.scheme, port_of(parts), parts.path.rstrip("/"),
                "localhost" if host in _LOOPBACK else host)
    return key(a) == key(b)
