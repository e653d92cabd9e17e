"""Token files of `hotweights serve`: sent to loopback URLs only, removed only if ours."""

import re

import pytest

from hotweights.errors import ConfigError, ServerError
from hotweights.protocol import tokens
from hotweights.protocol.tokens import find_token, remove_token, token_path, write_token


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("HOTWEIGHTS_TOKEN", raising=False)
    return tmp_path


@pytest.mark.parametrize(("url", "port"), [
    ("http://127.0.0.1:8000", 8000),
    ("http://127.3.4.5:8001/", 8001),
    ("http://localhost:8002", 8002),
    ("http://[::1]:8003", 8003),
    ("http://LOCALHOST", 80),
    ("https://localhost", 443),
])
def test_loopback_urls_read_the_token_file_of_their_port(home, url, port):
    write_token(token_path(port), f"t{port}")
    assert find_token(url) == f"t{port}"


@pytest.mark.parametrize("url", [
    "http://10.0.0.7:8000", "http://example.com:8000", "https://192.168.1.2:8000",
    "http://[2001:db8::1]:8000", "http://localhost.example.com:8000",
])
def test_other_hosts_never_get_the_local_token(home, url):
    write_token(token_path(8000), "local-secret")
    with pytest.raises(ServerError,
                       match=r"pass token= \(CLI: --token\) or set HOTWEIGHTS_TOKEN") as e:
        find_token(url)
    assert "local-secret" not in str(e.value)


def test_a_given_token_or_the_variable_go_anywhere(home, monkeypatch):
    assert find_token("http://10.0.0.7:8000", "given") == "given"
    monkeypatch.setenv("HOTWEIGHTS_TOKEN", "env")
    assert find_token("http://10.0.0.7:8000") == "env"


def test_no_token_file_names_the_file(home):
    with pytest.raises(ServerError, match=r"server-8000\.token"):
        find_token("http://127.0.0.1:8000")


def test_an_unreadable_token_file_is_named(home):
    path = token_path(8000)
    write_token(path, "x")
    path.write_bytes(b"\xff\xfe")  # not UTF-8: no traceback, the file named
    with pytest.raises(ConfigError, match=re.escape(f"cannot read the token in {path}")):
        find_token("http://127.0.0.1:8000")


def test_token_file_is_private_and_removed_only_if_still_ours(tmp_path):
    path = tmp_path / "sub" / "server.token"
    write_token(path, "ours")
    assert path.stat().st_mode & 0o777 == 0o600
    write_token(path, "theirs")  # another server took the port since
    assert not remove_token(path, "ours") and path.read_text() == "theirs\n"
    assert remove_token(path, "theirs") and not path.exists()
    assert not remove_token(path, "theirs")  # gone already: nothing to do


def test_a_token_file_is_replaced_at_once_never_seen_empty(tmp_path):
    path = tmp_path / "server.token"
    write_token(path, "old")
    with open(path) as reader:  # a client that opened it before the new server wrote
        write_token(path, "new")
        assert reader.read() == "old\n"  # its file was replaced, not truncated under it
    assert path.read_text() == "new\n" and path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["server.token"]  # no temp file left


@pytest.mark.parametrize(("url", "why"), [
    ("not-a-url", "no http:// or https://"),
    ("localhost:8000", "no http:// or https:// (http://localhost:8000?)"),
    ("http://h:1/?x=1", "a query or fragment after it"),
    ("ftp://x", "the scheme is 'ftp'"),
    ("http://127.0.0.1:99999", "port out of range"),
    ("http://localhost:abc", "port could not be cast"),
    ("http://[::1", "invalid IPv6 URL"),
    ("http://", "no host"),
    ("http://h:0", "port 0"),
    ("http://127.0.0.1:8000/a b", "a space or control character in it"),
])
def test_a_url_that_is_no_server_url_is_named_before_anything_is_sent(home, url, why):
    for token in (None, "given"):  # a given token does not skip the check
        with pytest.raises(ConfigError, match=rf"'{re.escape(url)}' is not a server URL: "
                                              rf"{re.escape(why)}"):
            find_token(url, token)


def test_a_token_with_a_space_inside_is_refused(home):
    with pytest.raises(ConfigError, match="holds whitespace"):
        find_token("http://10.0.0.1:8000", "s3cr3t token")


@pytest.mark.parametrize("where", ["env", "file"])
def test_a_blank_token_is_refused(home, monkeypatch, where):
    if where == "env":
        monkeypatch.setenv("HOTWEIGHTS_TOKEN", "  ")
    else:
        write_token(token_path(8000), "")
    with pytest.raises(ConfigError, match="is empty"):
        find_token("http://127.0.0.1:8000")


def test_the_token_directory_is_private(tmp_path):
    write_token(tmp_path / "d" / "server.token", "t")
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o700


def test_a_failed_token_write_leaves_no_temp_file(tmp_path, monkeypatch):
    def boom(a, b):
        raise OSError("replace failed")
    monkeypatch.setattr(tokens.os, "replace", boom)
    with pytest.raises(OSError):
        write_token(tmp_path / "server.token", "t")
    assert list(tmp_path.iterdir()) == []
