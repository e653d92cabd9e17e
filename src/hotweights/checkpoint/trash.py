"""Files a journal's moves replaced, kept in `DIR/.hotweights-trash/` and freed after the
commit, off its path: freeing a large file's blocks and cached pages is slow on some
filesystems (~0.2 s per 250 MB on ext4), and no reader needs to wait for it."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading

from hotweights.checkpoint import threads

__all__ = ["TRASH_DIR", "keep", "sweep", "wait"]

logger = logging.getLogger(__name__)

TRASH_DIR = ".hotweights-trash"
_sweeper: threading.Thread | None = None  # the thread freeing the last commit's trash


def keep(directory: str, target: str, name: str) -> None:
    """Hard-link `target` (`directory/name`), about to be replaced, into the trash: the
    rename then only swaps names, and `sweep` frees the old file later."""
    wait()
    trash = os.path.join(directory, TRASH_DIR)
    try:
        os.makedirs(trash, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(trash, name))
        os.link(target, os.path.join(trash, name))
    except OSError as e:  # no hard links here: the rename frees the old file itself
        logger.debug("%s: not kept for a later free: %s", target, e)


def wait() -> None:
    """Wait for the sweeper thread, if one runs."""
    if _sweeper is not None:
        _sweeper.join()


def sweep(directory: str, *, background: bool) -> None:
    """Remove the trash of `directory` (files replaced by moves), in a thread or now."""
    global _sweeper
    trash = os.path.join(directory, TRASH_DIR)
    if not os.path.lexists(trash):
        return
    wait()
    if background:  # a kill leaves the trash to recover
        if (t := threads.started(shutil.rmtree, trash, True, name="hotweights-sweep")):
            _sweeper = t
            return
    shutil.rmtree(trash, ignore_errors=True)
