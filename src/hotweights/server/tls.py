"""`hotweights serve --ssl-keyfile K --ssl-certfile C`: the files, checked before vLLM starts."""

from __future__ import annotations

import re
import ssl

from hotweights.errors import ConfigError

_FIRST_PEM = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


def check_files(keyfile: str | None, certfile: str | None) -> bool:
    """Whether to serve https: both given, readable, a PEM certificate and its key.

    Checked here because vLLM reads them only once the model has loaded.

    Raises:
        ConfigError: naming the flag and the file at fault.
    """
    if keyfile is None and certfile is None:
        return False
    if keyfile is None or certfile is None:
        given, missing = ("--ssl-certfile", "--ssl-keyfile") if keyfile is None else \
            ("--ssl-keyfile", "--ssl-certfile")
        raise ConfigError(f"{given} without {missing}: https needs both the certificate "
                          "chain and its private key")
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile)):
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            raise ConfigError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
            certfile, keyfile, password=lambda: _encrypted(keyfile))
    except ssl.SSLError as e:
        raise ConfigError(f"--ssl-certfile {certfile}, --ssl-keyfile {keyfile}: not a PEM "
                          f"certificate chain and its private key ({e})") from None
    return True


def probe_context(certfile: str) -> ssl.SSLContext:
    """TLS for the runner's own probe of its server (on loopback): trusts exactly the
    server's certificate, whatever host names it lists; not the chain after it in the file
    (an intermediate CA there would vouch for any certificate it issued: an impostor on
    the port would get the probe's token)."""
    with open(certfile, encoding="ascii", errors="replace") as f:
        first = _FIRST_PEM.search(f.read())
    if first is None:
        raise ConfigError(f"--ssl-certfile {certfile}: no PEM certificate in it")
    context = ssl.create_default_context(cadata=first[0])
    context.check_hostname = False  # the probe dials 127.0.0.1, the certificate a public name
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # the leaf itself is the anchor
    return context


def _encrypted(keyfile: str) -> bytes:
    raise ConfigError(f"--ssl-keyfile {keyfile}: the key is encrypted and vLLM takes no "
                      f"password; decrypt it (openssl pkey -in {keyfile} -out KEY.pem, "
                      "mode 0600)")
