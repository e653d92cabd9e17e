"""The access token of a `hotweights serve`: where it is kept, and how a client finds it.

`hotweights serve --port PORT` writes its token to a per-port file (mode 0600) once it
answers, and removes it when it stops. The file is this machine's: a client uses it only
for a loopback URL, never sends it to another host.
"""

from __future__ import annotations

import os
import tempfile
import urllib.parse
from pathlib import Path

from hotweights.errors import ConfigError, ServerError
from hotweights.protocol.urls import is_loopback, port_of, server_url


def token_path(port: int) -> Path:
    """Where `hotweights serve --port PORT` writes its token unless told otherwise."""
    return Path.home() / ".cache" / "hotweights" / f"server-{port}.token"


def write_token(path: Path, token: str) -> None:
    """Write `token` to `path`, mode 0600 (created or replaced at once: a client reading it
    meanwhile finds the old file or the new one, never an empty one)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:  # (mode 0600, a name nobody could take first)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_token(path: Path, token: str) -> bool:
    """Remove `path` if it still holds `token` (another server may have taken the port
    since, and written its own). Returns whether it was removed."""
    try:
        if path.read_text().strip() != token:
            return False
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def find_token(url: str, token: str | None = None) -> str:
    """`token`, else $HOTWEIGHTS_TOKEN, else (loopback URLs only) the file `hotweights
    serve` wrote for the port.

    Raises:
        ConfigError: `url` is not a server URL (`urls.server_url`).
        ServerError: no token given, and `url` is not a loopback URL or no file exists.
    """
    url = server_url(url)
    if token is not None and not isinstance(token, str):
        raise ConfigError(f"{url}: token= must be a str, found {type(token).__name__}")
    if token or (token := os.environ.get("HOTWEIGHTS_TOKEN")):
        return checked(token, url)
    parts = urllib.parse.urlsplit(url)
    if not is_loopback(parts.hostname):
        raise ServerError(f"{url}: no token: pass token= (CLI: --token) or set "
                          "HOTWEIGHTS_TOKEN (the token files of local servers are sent to "
                          "loopback URLs only)")
    port = port_of(parts)
    path = token_path(port)
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{url}: cannot read the token in {path} "
                              f"({getattr(e, 'strerror', None) or e}); pass token= (CLI: "
                              "--token or --token-file) or set HOTWEIGHTS_TOKEN") from None
        return checked(text, url)
    raise ServerError(f"{url}: no token: no {path}, which `hotweights serve --port {port}` "
                      "run by this user writes once it answers (is it running, or was it "
                      "given --token-file?); else pass token= (CLI: --token or --token-file) "
                      "or set HOTWEIGHTS_TOKEN")


def checked(token: str, where: str) -> str:
    """`token` without surrounding whitespace (a file's newline), once it can go in an HTTP
    header (`where` names whose it is: never the token itself).

    Raises:
        ConfigError: an empty token, or one with whitespace, control or non-ASCII
            characters inside.
    """
    token = token.strip()
    if not token or not token.isascii() or any(c.isspace() or not c.isprintable()
                                               for c in token):
        raise ConfigError(f"{where}: the token (token=, --token, HOTWEIGHTS_TOKEN or the "
                          "token file) is empty or holds whitespace, control or non-ASCII "
                          "characters inside it; pass the token alone (it is not shown "
                          "here)")
    return token
