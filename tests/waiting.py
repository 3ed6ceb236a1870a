"""The one polled wait of the tests, for every tier (tests/conftest.py puts this folder on sys.path):

    from waiting import wait_for
    ckpt = wait_for("a complete checkpoint", lambda: latest_complete(run), 60)          # returns the value
    wait_for("the restart", lambda: started(1), 90, poll_s=0.5, on_poll=cluster.kick)  # kick ~1/s meanwhile

Bounded (AssertionError naming what it waited for, for how long, and the last value seen), polled, and
logged (logger "tests.waiting") so a slow cluster test's log says what it was waiting on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("tests.waiting")
T = TypeVar("T")


def wait_for(what: str, predicate: Callable[[], T], timeout_s: float = 60, *, poll_s: float = 0.1,
             on_poll: Callable[[], object] | None = None, on_poll_every_s: float = 1.0) -> T:
    """Poll `predicate` every `poll_s` until it returns something truthy, and return that; at most
    `timeout_s`. `on_poll` (e.g. a scheduler kick) runs at most once per `on_poll_every_s` meanwhile."""
    log.info("waiting up to %.1f s for %s", timeout_s, what)
    start = time.monotonic()
    last_hook = start
    value: T = predicate()
    while not value:
        now = time.monotonic()
        if now - start >= timeout_s:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last value: {value!r})")
        if on_poll is not None and now - last_hook >= on_poll_every_s:
            on_poll()
            last_hook = now
        time.sleep(poll_s)
        value = predicate()
    log.info("%s after %.2f s", what, time.monotonic() - start)
    return value
