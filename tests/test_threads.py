"""The thread fixture itself (tests/threads.py): a thread's exception and a hung thread fail a test."""

import threading

import pytest

from tests.threads import ThreadErrors, Threads


def test_an_exception_in_a_thread_fails_the_join(monkeypatch):
    errors = ThreadErrors()
    monkeypatch.setattr(threading, "excepthook", errors.hook)
    checked = Threads(errors)

    def boom():
        raise ValueError("raised in the thread")

    checked.start(boom, name="boomer")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)'boomer'.*ValueError: raised in the thread"):
        checked.join()
    checked.join()   # reported once: a second check (the fixture's teardown) finds nothing new


def test_a_hung_thread_fails_the_join_naming_it(threads):
    release = threading.Event()
    errors = ThreadErrors()
    hung = Threads(errors)
    hung.start(release.wait, name="waits forever")
    with pytest.raises(AssertionError, match="still alive.*'waits forever'"):
        hung.join(deadline_s=0)   # nothing sets the event before the check: alive, whatever the machine
    release.set()
    # A well-behaved thread through the fixture: its return value comes back.
    summed = threads.start(sum, [1, 2, 3])
    threads.join()
    assert summed.result == 6 and not summed.is_alive() and not errors.seen


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # pytest's hook, chained
def test_an_exception_in_a_thread_the_test_did_not_start_fails_the_test(thread_exceptions):
    t = threading.Thread(target=lambda: 1 / 0, name="library thread")   # not through the fixture
    t.start()
    t.join()
    with pytest.raises(pytest.fail.Exception, match=r"(?s)'library thread'.*ZeroDivisionError"):
        thread_exceptions.check()   # what the autouse fixture's teardown does (consumed here: this test passes)
