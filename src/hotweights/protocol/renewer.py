"""A thread that renews an update's lease every `lease_s / 3` while the trainer works."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hotweights.errors import HotweightsError, RemoteError, ServerError

logger = logging.getLogger(__name__)

MAX_LEASE_S = 24 * 3600.0  # the longest update lease a server grants


class Renewer(threading.Thread):
    """``with Renewer(renew, lease_s):`` calls ``renew(lease_s)`` every ``lease_s / 3`` s
    until the block ends, so a step, an encode or a send may take as long as it needs while
    a dead trainer still frees its servers within `lease_s`. A renewal that got no answer
    (a network blip) is tried again at the next; the first refusal stops it (logged: what
    comes next, the commit, says what happened)."""

    def __init__(self, renew: Callable[[float], object], lease_s: float):
        super().__init__(daemon=True, name="hotweights-renew")
        self.renew, self.lease_s = renew, lease_s
        self.done = threading.Event()

    def __enter__(self) -> Renewer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        if self.ident is not None:  # started (a start that failed: nothing to join)
            self.join()

    def run(self) -> None:
        # due every lease_s / 3 from the start, not from the last answer: a renewal that
        # waited out its timeout (a third of the lease) is followed by the next at once
        period = self.lease_s / 3
        due = time.monotonic() + period
        while not self.done.wait(max(0.0, due - time.monotonic())):
            due += period
            try:
                self.renew(self.lease_s)
            except HotweightsError as e:
                if not _no_answer(e):  # a server refused: the lease is gone
                    logger.warning("hotweights: lease renewal failed: %s", e)
                    return
                logger.warning("hotweights: lease renewal got no answer (%s); trying again "
                               "in %.0f s", e, self.lease_s / 3)


def _no_answer(e: HotweightsError) -> bool:
    """Whether `e` says only that no answer came (a server's, or every remote server's)."""
    return unanswered(e) or isinstance(e, RemoteError) and e.no_answer


def unanswered(e: Exception) -> bool:
    """Whether `e` says only that a server's answer did not come: none, or a proxy's or
    gateway's 502/503/504 in its place (hotweights' routes never answer a renewal so)."""
    return isinstance(e, ServerError) and e.status in (None, 502, 503, 504)
