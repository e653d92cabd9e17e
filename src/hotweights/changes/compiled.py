"""Whether numba-compiled loops may run in this process (`changes.xxh3_loop`,
`hotweights.remote.jit`): numba installed and not switched off with ``HOTWEIGHTS_JIT=0``.

Importing numba here also guards vLLM's engine start from llvmlite (`_guard_llvmlite`), so
every user of the compiled loops asks `numba_ready` first.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def numba_ready() -> bool:
    """numba imported (and llvmlite guarded), unless it is missing or switched off."""
    if os.environ.get("HOTWEIGHTS_JIT", "1") == "0":
        return False
    try:
        import numba  # noqa: F401
    except ImportError:
        logger.info("hotweights: numba not installed: the numpy loops run")
        return False
    _guard_llvmlite()
    return True


def _guard_llvmlite() -> None:
    """vLLM (0.32) starts an engine by walking every object of every module and reading
    ``vars(obj)`` wherever ``hasattr(obj, "__dict__")`` (rebinding its Triton kernels).
    llvmlite's library wrapper (numba's) answers any attribute name with a C function
    wrapper, ``__dict__`` too, so an engine started in a process that imported numba died
    (AttributeError: '_lib_fn_wrapper' object has no attribute 'get'). No C function is
    named like a dunder: those names are refused."""
    from llvmlite.binding import ffi

    wrapper = getattr(ffi, "_lib_wrapper", None)  # None: another llvmlite; nothing to guard
    if wrapper is None or getattr(wrapper, "_hotweights_guarded", False):
        return
    lookup = wrapper.__getattr__

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    wrapper.__getattr__ = __getattr__
    wrapper._hotweights_guarded = True
