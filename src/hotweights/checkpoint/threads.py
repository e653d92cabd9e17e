"""The threads a sync works in (hashing, staging, the finisher, the trash sweeper), and
the caller's thread instead while the interpreter exits: the finisher of a sync at the end
of a script runs while thread pools take no more work, and a sync from an atexit handler
once the main thread has ended, when a thread started is not waited for either."""

from __future__ import annotations

import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor

__all__ = ["exiting", "pool", "started"]


def exiting() -> bool:
    """Whether the interpreter is exiting: shutting down (thread pools then take no more
    work, the main thread alive or not) or the main thread ended (atexit handlers run then).
    """
    return getattr(threading, "_SHUTTING_DOWN", False) or not threading.main_thread().is_alive()


def started(target, *args, name: str) -> threading.Thread | None:
    """`target(*args)` in a new thread (not a daemon: the interpreter waits for it),
    started; None where none can run it: the interpreter exiting (nothing would wait for
    it), or no thread can be started (a limit on threads). The caller then runs it."""
    if exiting():
        return None
    t = threading.Thread(target=target, args=args, name=name)
    try:
        t.start()
    except RuntimeError:  # "can't start new thread"
        return None
    return t


class _Here(Executor):
    """An executor that runs each job at once, in the caller's thread."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        done: Future = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - the job's, for its result()
            done.set_exception(e)
        return done


class _Pool(ThreadPoolExecutor):
    """A thread pool that works with the threads it has where no more can be started (a
    limit on threads): a job queued then waits for one of them."""

    def _adjust_thread_count(self) -> None:
        try:
            super()._adjust_thread_count()
        except RuntimeError:  # "can't start new thread"
            if not self._threads:
                raise


def pool(workers: int, **kwargs) -> Executor:
    """A `ThreadPoolExecutor(workers, **kwargs)` with one worker started at least; an
    executor that runs each job in the caller's thread where none can be: the interpreter
    exiting (`exiting`), or no thread to be had (a limit on threads)."""
    if not exiting():
        executor = _Pool(workers, **kwargs)
        try:
            executor._adjust_thread_count()  # the first worker, now
            return executor
        except RuntimeError:
            executor.shutdown(wait=False)
    return _Here()
