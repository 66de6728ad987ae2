"""A test's request to the coupled reference, sent while the test drives the disaggregated path.

A parity test needs both answers, and they come from different engines: overlapped, the test waits
for the slower one instead of their sum (the engine tests otherwise drive one engine at a time and
leave a core idle). Only requests to different engines overlap, so each engine sees the same
batches as with sequential requests and even logprobs compare exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="overlap")


def in_background(call: Callable[[], T]) -> Future[T]:
    """Start ``call`` now; ``.result()`` waits for it (and raises what it raised)."""
    return _POOL.submit(call)
