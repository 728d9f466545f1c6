"""Calling megatron-core across its releases, whose signatures drift: keep the keyword arguments a
function takes. A leaf module, so that every other module may import it."""

from __future__ import annotations

import inspect


def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def supported_kwargs(fn, **kwargs) -> dict:
    """``kwargs`` restricted to the parameters ``fn`` takes (megatron-core signatures drift)."""
    return {k: v for k, v in kwargs.items() if _accepts(fn, k)}
