"""remote.hosts: server lists as URLs, host:port items and SLURM node lists."""

import pytest

from hotweights.errors import ConfigError
from hotweights.remote.hosts import expand_nodes, server_urls


def test_slurm_node_lists_expand_with_their_padding():
    assert expand_nodes("gpu[01-03,07],cpu1") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]
    assert expand_nodes("n[8-10]x") == ["n8x", "n9x", "n10x"]


def test_server_urls_from_every_form():
    assert server_urls("http://a:9000/, b, c:8100") == ["http://a:9000", "http://b:8000",
                                                        "http://c:8100"]
    assert server_urls(["gpu[1-2]:8001"]) == ["http://gpu1:8001", "http://gpu2:8001"]
    assert server_urls("gpu[1-2]", port=7000) == ["http://gpu1:7000", "http://gpu2:7000"]
    assert server_urls("https://gpu[01-02]:8443/, https://[::1]:9000") == [
        "https://gpu01:8443", "https://gpu02:8443", "https://[::1]:9000"]
    assert server_urls("https://n[1-2]") == ["https://n1", "https://n2"]  # as https://n1
    assert server_urls("https://n1, http://n2") == ["https://n1", "http://n2"]
    assert server_urls({"http://a:1": "t", "b": "u"}) == ["http://a:1", "http://b:8000"]
    assert server_urls("[::1]:9000, [fd00::2]/") == ["http://[::1]:9000",  # IPv6, no scheme
                                                     "http://[fd00::2]:8000"]
    assert server_urls("gpu[01-02]-ib:9000, n[1-2].cluster") == [  # a suffix after the list
        "http://gpu01-ib:9000", "http://gpu02-ib:9000", "http://n1.cluster:8000",
        "http://n2.cluster:8000"]


@pytest.mark.parametrize("bad, match", [
    ("", "no servers"),
    ("a,a:8000", "servers named twice: http://a:8000"),
    ("gpu[3-1]", "range '3-1' runs backwards"),
    ("gpu[x]", "'x' is not N or N-M"),
    ("gpu[1-2", "cannot read 'gpu\\[1-2'"),
    ("ftp://a:21", "'ftp://a:21' is not a server URL: the scheme is 'ftp'"),
    ("gpu[1-2]:99999", "'http://gpu1:99999' is not a server URL: port out of range"),
    ("http://a:x", "'http://a:x' is not a server URL: port could not be cast"),
])
def test_bad_lists_are_named(bad, match):
    with pytest.raises(ConfigError, match=match):
        server_urls(bad)


def test_a_range_of_one_node_and_a_stray_bracket():
    assert expand_nodes("n[5-5],m[07-07]") == ["n5", "m07"]
    with pytest.raises(ConfigError, match=r"cannot read 'gpu\]1'"):
        expand_nodes("gpu]1")


def test_bytes_are_not_a_server_list():
    with pytest.raises(ConfigError, match=r"servers: a str or a list of str, found b'a:1'"):
        server_urls(b"a:1")


def test_a_free_port_on_an_ipv6_address():
    # (not guarded by `free_port` itself: an IPv4-only one would skip the check)
    import socket

    from hotweights.remote.hosts import free_port

    with socket.socket(socket.AF_INET6) as s:
        try:
            s.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 on this host's loopback")
    assert free_port("::1") > 0


def test_a_host_with_a_trailing_slash_or_a_path_gets_the_default_port_before_it():
    # not "http://localhost/:8000": port 80, at the path "/:8000"
    assert server_urls("localhost/, a:9000/, b/base") == [
        "http://localhost:8000", "http://a:9000", "http://b:8000/base"]


def test_a_node_list_with_a_path_keeps_it_after_each_node_s_port():
    assert server_urls("gpu[01-02]:9000/v1, n[1-2]/x/") == [
        "http://gpu01:9000/v1", "http://gpu02:9000/v1", "http://n1:8000/x", "http://n2:8000/x"]
    assert server_urls("https://gpu[1-2]:8443/base") == ["https://gpu1:8443/base",
                                                          "https://gpu2:8443/base"]
