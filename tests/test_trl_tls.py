"""TRL's client for an https `hotweights serve`: the bridge's CA bundle reaches TRL's
`requests` session (TRL's own server check uses a bare `requests.get`, blind to it)."""

from types import SimpleNamespace

import pytest

pytest.importorskip("trl")

from hotweights.integrations.trl import _client_for  # noqa: E402
from hotweights.protocol.http import CA_FILE_ENV  # noqa: E402


@pytest.fixture
def https_url(json_server, tls):
    port = json_server(*tls.leaf("localhost", "127.0.0.1"), answer={"data": [{"id": "tiny"}]})
    return f"https://127.0.0.1:{port}"


@pytest.mark.parametrize("given", ["bridge", "env"])
def test_trl_client_trusts_the_bridges_ca_bundle(https_url, tls, monkeypatch, given):
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    if given == "env":
        monkeypatch.setenv(CA_FILE_ENV, tls.ca)
    bridge = SimpleNamespace(cafile=tls.ca if given == "bridge" else None)
    client = _client_for(bridge)(base_url=https_url)
    assert client.model == "tiny" and client.session.verify == tls.ca


def test_without_the_ca_bundle_the_certificate_is_refused(https_url, monkeypatch):
    for name in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", CA_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    import requests
    from trl.generation import vllm_client

    # TRL's session retries with a backoff (a minute in all): one try is enough here
    monkeypatch.setattr(vllm_client, "HTTPAdapter", lambda **_: requests.adapters.HTTPAdapter())
    with pytest.raises(requests.exceptions.SSLError):
        _client_for(SimpleNamespace(cafile=None))(base_url=https_url)


def test_a_ca_bundle_given_as_a_path_is_trusted_too(https_url, tls, monkeypatch):
    # requests takes `verify` as a str only: a Path would be ignored for the system's store
    from pathlib import Path

    for name in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", CA_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    client = _client_for(SimpleNamespace(cafile=Path(tls.ca)))(base_url=https_url)
    assert client.model == "tiny" and client.session.verify == tls.ca
