"""protocol.renewer: the lease renewed while the trainer works; a blip is tried again."""

import time

from hotweights.errors import RemoteError, ServerError
from hotweights.protocol.renewer import Renewer


def _renewals(answers: list, lease_s: float = 0.03) -> list[float]:
    """Run a Renewer whose renew gives `answers` in turn (an exception is raised), until
    they are used up or it stops by itself; the lease_s of each call."""
    calls = []

    def renew(lease_s):
        calls.append(lease_s)
        answer = answers.pop(0) if answers else "ok"
        if isinstance(answer, Exception):
            raise answer

    with Renewer(renew, lease_s) as renewer:
        deadline = time.monotonic() + 5
        while answers and renewer.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
    return calls


def test_a_renewal_with_no_answer_is_tried_again():
    blip = ServerError("POST /hotweights/renew: no answer within 30 s")  # status None
    assert len(_renewals([blip, blip, "ok"])) >= 3


def test_a_gateway_s_5xx_in_place_of_the_server_s_answer_is_tried_again():
    for status in (502, 503, 504):  # a reverse proxy in front: hotweights never answers so
        blip = ServerError(f"POST /hotweights/renew: HTTP {status}: Bad Gateway", status)
        assert len(_renewals([blip, "ok"])) >= 2


def test_a_refusal_stops_the_renewals(caplog):
    refused = ServerError("POST /hotweights/renew: HTTP 409: lease held by h2", 409)
    calls = _renewals([refused, "never asked"], lease_s=0.02)
    assert len(calls) == 1 and "lease renewal failed" in caplog.text
    assert len(_renewals([RemoteError("rank 1 gone"), "never asked"], lease_s=0.02)) == 1


def test_servers_that_did_not_answer_are_tried_again_a_refusal_among_them_stops():
    """`RemoteGroup.renew` with require="all": a blip on one server (no_answer) does not end
    the renewals of the rest; a server that refused does."""
    blip = RemoteError("http://b:8000: POST /hotweights/renew: no answer", no_answer=True)
    assert len(_renewals([blip, blip, "ok"])) >= 3
    assert len(_renewals([RemoteError("http://b:8000: HTTP 409"), "never"], lease_s=0.02)) == 1


def test_a_renewal_that_waited_out_its_timeout_is_followed_by_the_next_at_once():
    # each renewal may wait a third of the lease for its answer: counted from the answer,
    # the next would come a third of the lease later, as the lease runs out
    lease_s, starts = 3.0, []  # (its margins: tenths of a second on a loaded machine)

    def renew(lease):
        starts.append(time.monotonic())
        if len(starts) == 2:
            time.sleep(lease / 3)  # no answer until its timeout

    with Renewer(renew, lease_s):
        time.sleep(1.5 * lease_s)
    assert len(starts) >= 3
    assert starts[2] - (starts[1] + lease_s / 3) < 0.25 * lease_s  # not lease_s / 3 later


def test_each_renewal_asks_for_the_whole_lease():
    assert set(_renewals(["ok", "ok"], lease_s=0.03)) == {0.03}
