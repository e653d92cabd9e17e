"""`hotweights status` printing, for a status in every state (no server needed)."""

import json

import pytest

from hotweights.cli.status import rows

BASE = dict(version="3@ab12cd34", holder=None, mode=None, lease_expires=None, dirty=False,
            dirty_reason=None, dirty_versions=[], updates=3, last_pause_s=0.02,
            last_commit_s=0.003, last_update_s=0.05, last_paused_s=0.012)


@pytest.mark.parametrize("state", ["idle", "draining", "paused", "staging", "committing",
                                   "expired"])
def test_every_state_prints(state):
    status = dict(BASE, state=state)
    if state in ("draining", "paused", "committing"):
        status.update(holder="host:1:abc", mode="wait")
    if state == "paused":
        status["lease_expires"] = 1030.0
    printed = dict(rows(status, now=1000.0))
    assert printed["weight version"] == "3@ab12cd34"
    if state == "draining":  # holder set, no lease deadline yet: no TypeError
        assert printed["lease"] == "host:1:abc (wait)" and "in-flight" in printed["state"]
    if state == "paused":
        assert printed["lease"] == "host:1:abc (wait), expires in 30 s"
        status["lease_left_s"] = 12.0  # the server's own count: its clock may be another's
        assert dict(rows(status, now=5000.0))["lease"] == "host:1:abc (wait), expires in 12 s"
    assert printed["state"] != state  # every state has its words
    assert (printed["to pause"], printed["paused"], printed["commit"], printed["update"]) == (
        "20.0 ms", "12.0 ms", "3.0 ms", "50.0 ms")


def test_an_armed_remote_server_says_so():
    assert "armed" in dict(rows(dict(BASE, state="idle", armed=True), now=0.0))["remote"]
    assert "remote" not in dict(rows(dict(BASE, state="idle", armed=False), now=0.0))


def test_dirty_weights_say_why_and_what_clears_it():
    status = dict(BASE, state="expired", dirty=True, dirty_reason="lease of t expired",
                  dirty_versions=["2@ab12cd34", "3@ab12cd34"])
    printed = dict(rows(status, now=0.0))
    assert printed["weights"] == ("DIRTY: lease of t expired; the next clean commit clears it")
    assert printed["dirty versions"] == "2@ab12cd34, 3@ab12cd34"


def test_the_last_lease_that_ended_unasked_says_how():
    gone = dict(holder="h", at=990.0, version="3@ab12cd34", staged=False, dirty=False,
                why="the process of h (pid 7) exited")
    printed = dict(rows(dict(BASE, state="idle", expired=gone), now=1000.0))
    assert printed["lease ended"] == "the process of h (pid 7) exited, 10 s ago"
    gone["ago_s"] = 3.0  # the server's own count: its clock may be another's
    assert dict(rows(dict(BASE, state="idle", expired=gone), now=9999.0))["lease ended"] == \
        "the process of h (pid 7) exited, 3 s ago"
    older = dict(holder="h", at="?", version="3@ab12cd34", staged=True)  # an older server
    assert dict(rows(dict(BASE, state="idle", expired=older), now=0.0))["lease ended"] == \
        "lease of h expired"
    assert "lease ended" not in dict(rows(dict(BASE, state="idle", expired=None), now=0.0))


def test_fields_of_unexpected_types_print_as_they_are():
    """Another version's server, say: printed, never a traceback."""
    status = dict(BASE, state="idle", dirty=True, dirty_versions=[1, 2], last_pause_s="abc")
    printed = dict(rows(status, now=0.0))
    assert printed["dirty versions"] == "1, 2" and "to pause" not in printed
    odd = dict(rows(dict(BASE, state=["x"], dirty_versions=5), now=0.0))
    assert (odd["state"], odd["dirty versions"]) == ("['x']", "5")
    assert dict(rows({"version": "1@ab"}, now=0.0))["state"] == "unknown"


def test_the_token_comes_from_token_file_and_an_unreadable_one_is_named(tmp_path, capsys,
                                                                         monkeypatch):
    from hotweights.cli import status
    from hotweights.cli.main import main

    asked = []
    monkeypatch.setattr(status, "server_status", lambda url, token, cafile=None, timeout=0: (
        asked.append(token), dict(BASE, state="idle"))[1])
    (tmp_path / "t").write_text("s3cret\n")
    assert main(["status", "--token-file", str(tmp_path / "t"), "--json"]) == 0
    assert asked == ["s3cret\n"]  # stripped and checked where it is sent (find_token)
    (tmp_path / "empty").write_text("\n")  # not a reason to look for the token elsewhere
    for argv in (["--token-file", str(tmp_path / "nope")],
                 ["--token-file", str(tmp_path / "empty")],
                 ["--token", "x", "--token-file", str(tmp_path / "t")]):
        with pytest.raises(SystemExit) as e:
            main(["status", *argv])
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'nope'}: cannot read a token: No such file or directory" in err
    assert "not allowed with argument" in err and f"{tmp_path / 'empty'}: empty" in err


def test_an_answer_that_is_no_hotweights_status_is_one_line(monkeypatch, capsys):
    from hotweights.cli.main import main
    from hotweights.protocol import http

    for answer in ({"state": "idle"}, ["x"]):
        monkeypatch.setattr(http, "request", lambda *a, answer=answer, **k: answer)
        assert main(["status", "--token", "t", "--json"]) == 1
        out, err = capsys.readouterr()
        assert "/hotweights/status: not a hotweights status (no 'version' string" in err
        assert json.loads(out)["error"] == err.removeprefix("error: ").rstrip("\n")


def test_the_server_is_a_word_or_the_flag_sync_and_diagnose_take(monkeypatch, capsys):
    from hotweights.cli import status
    from hotweights.cli.main import main

    asked = []
    monkeypatch.setattr(status, "server_status", lambda url, token, cafile=None, timeout=0: (
        asked.append((url, timeout)), dict(BASE, state="idle"))[1])
    for argv in ([], ["http://h:1"], ["--server", "http://h:2"]):
        assert main(["status", *argv, "--token", "t", "--json"]) == 0
    # a status is answered at once: a port that takes the connection and never answers
    # is given up on in seconds, not the 2 minutes an update's routes may take
    assert asked == [(url, status.STATUS_TIMEOUT_S) for url in (
        "http://127.0.0.1:8000", "http://h:1", "http://h:2")] and status.STATUS_TIMEOUT_S <= 15
    with pytest.raises(SystemExit) as e:
        main(["status", "http://h:1", "--server", "http://h:2"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_dirty_weights_with_no_reason_say_an_update_was_interrupted():
    printed = dict(rows(dict(BASE, state="idle", dirty=True, dirty_reason=None), now=0.0))
    assert printed["weights"] == ("DIRTY: update interrupted; the next clean commit clears it")


def test_a_lease_that_ended_by_a_clock_ahead_of_this_one_ended_0_s_ago():
    # an older server's "at" only: its clock may run ahead of this machine's
    gone = dict(holder="h", at=1010.0, why="lease of h expired")
    printed = dict(rows(dict(BASE, state="idle", expired=gone), now=1000.0))
    assert printed["lease ended"] == "lease of h expired, 0 s ago"


def test_a_status_without_updates_or_timings_says_0_updates():
    printed = dict(rows({"version": "1@ab", "state": "idle"}, now=0.0))
    assert printed["updates"] == "0"
    assert not {"to pause", "paused", "commit", "update"} & printed.keys()
    assert "remote" not in dict(rows({"version": "1@ab", "armed": None}, now=0.0))


def test_status_prints_the_server_then_one_line_a_row(monkeypatch, capsys):
    from hotweights.cli import status
    from hotweights.cli.main import main

    monkeypatch.setattr(status, "server_status", lambda url, token, cafile=None, timeout=0:
                        dict(BASE, state="idle"))
    assert main(["status", "http://h:1", "--token", "t"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "http://h:1"
    assert lines[1:] == [f"  {key:<15}{value}"
                         for key, value in rows(dict(BASE, state="idle"), now=0.0)]
    assert "  paused         12.0 ms" in lines


def test_a_token_file_that_is_not_text_is_named(tmp_path, capsys):
    from hotweights.cli.main import main

    (tmp_path / "t").write_bytes(b"\xff\xfe\x00token")
    with pytest.raises(SystemExit) as e:
        main(["status", "--token-file", str(tmp_path / "t")])
    assert e.value.code == 2
    assert f"argument --token-file: {tmp_path / 't'}: cannot read a token: " in \
        capsys.readouterr().err


def test_status_json_is_the_server_s_answer_alone(monkeypatch, capsys):
    from hotweights.cli import status
    from hotweights.cli.main import main

    monkeypatch.setattr(status, "server_status", lambda url, token, cafile=None, timeout=0:
                        dict(BASE, state="idle"))
    assert main(["status", "--token", "t", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == dict(BASE, state="idle")  # nothing else


def test_a_lease_past_its_expiry_by_this_machine_s_clock_expires_in_0_s():
    # an older server's lease_expires only: its clock may run behind this machine's
    printed = dict(rows(dict(BASE, state="paused", holder="h", mode="wait",
                             lease_expires=990.0), now=1000.0))
    assert printed["lease"] == "h (wait), expires in 0 s"
