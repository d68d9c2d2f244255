"""Threads in tests: a thread that dies or hangs fails the test instead of passing silently.

Contract:
- `threads` (fixture): `threads.start(fn, *args, name=..., **kwargs)` starts a daemon thread and
  returns it; its return value lands in `thread.result` once it finished. `threads.join()` joins
  every thread started so far against one deadline (JOIN_DEADLINE_S), then fails the test naming
  each thread still alive (a deadlock: a policy that never releases a pull) and re-raises, with its
  traceback, the first exception raised in any thread. The fixture calls it again at teardown, so a
  test that forgets to join still fails. Call it inside the test before asserting on what the
  threads did, so the failure is the test's own and not an error at teardown.
- `thread_exceptions` (autouse, every test): while a test runs, `threading.excepthook` records
  an exception that escapes any thread, also one the test did not start itself (a server's or a
  library's), and the test fails at teardown naming the thread. pytest alone only warns about those.
  The previous hook still runs, so pytest's own warning and report are unchanged.
Daemon threads, so a deadlocked one never keeps the interpreter from exiting after the failure.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable

import pytest

JOIN_DEADLINE_S = 30.0   # a deadlock, not a slow machine: the threads here do milliseconds of work


class ThreadErrors:
    """Exceptions that escaped threads during one test: (thread name, formatted traceback, exception)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()   # guards `seen` (the hook runs in the dying thread)
        self.seen: list[tuple[str, str, BaseException | None]] = []

    def hook(self, args: threading.ExceptHookArgs) -> None:
        name = "<unknown>" if args.thread is None else args.thread.name
        text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
        with self.lock:
            self.seen.append((name, text, args.exc_value))

    def check(self) -> None:
        with self.lock:
            seen, self.seen = self.seen, []   # reported once, by whichever check comes first
        if seen:
            pytest.fail("exception in thread " + "\n".join(f"{name!r}:\n{text}" for name, text, _ in seen),
                        pytrace=False)


class Threads:
    """Start threads for one test; `join()` fails the test on a hung thread or a thread's exception."""

    def __init__(self, errors: ThreadErrors) -> None:
        self.errors = errors
        self.started: list[threading.Thread] = []

    def start(self, target: Callable, *args, name: str | None = None, **kwargs) -> threading.Thread:
        def run() -> None:
            thread.result = target(*args, **kwargs)   # an exception goes to threading.excepthook

        thread = threading.Thread(target=run, name=name or f"test-thread-{len(self.started)}", daemon=True)
        thread.result = None
        self.started.append(thread)
        thread.start()
        return thread

    def join(self, deadline_s: float = JOIN_DEADLINE_S) -> None:
        deadline = time.monotonic() + deadline_s
        joining, self.started = self.started, []   # each thread is judged once (not again at teardown)
        for t in joining:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in joining if t.is_alive()]
        assert not alive, f"threads still alive {deadline_s:.0f}s after the test: {alive} (deadlocked?)"
        self.errors.check()


@pytest.fixture(autouse=True)
def thread_exceptions():
    """Fail the test when an exception escapes any thread while it runs (see the module docstring)."""
    errors = ThreadErrors()
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        errors.hook(args)
        previous(args)

    threading.excepthook = hook
    try:
        yield errors
    finally:
        threading.excepthook = previous
    errors.check()


@pytest.fixture
def threads(thread_exceptions):
    """Factory of checked threads (see the module docstring); joined and checked at teardown too."""
    t = Threads(thread_exceptions)
    yield t
    t.join()
