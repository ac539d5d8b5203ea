"""The suite's own scheduling (tests/conftest.py): a test marked `alone` runs with nothing beside
it on pytest-xdist's other workers, and the others run side by side."""

import threading
import time

from tests.conftest import run_slot


def test_shared_slots_overlap_and_an_alone_one_waits_for_them_and_holds_off_new_ones(tmp_path):
    events: list[str] = []
    first_in, release_first = threading.Event(), threading.Event()

    def shared(name: str, entered: threading.Event | None = None, hold: threading.Event | None = None):
        with run_slot(False, tmp_path):
            events.append(f"{name} in")
            if entered:
                entered.set()
            if hold:
                hold.wait(10)
            events.append(f"{name} out")

    def alone():
        with run_slot(True, tmp_path):
            events.append("alone in")
            time.sleep(0.2)
            events.append("alone out")

    first = threading.Thread(target=shared, args=("first", first_in, release_first))
    first.start()
    assert first_in.wait(10)
    with run_slot(False, tmp_path):  # a second shared slot while the first is held: no waiting
        events.append("second in")
    waiter = threading.Thread(target=alone)
    waiter.start()
    time.sleep(0.3)  # the alone test now waits for `first`, holding the turnstile
    late = threading.Thread(target=shared, args=("late",))
    late.start()
    time.sleep(0.3)
    assert "alone in" not in events and "late in" not in events  # nobody passed the waiting alone test
    release_first.set()
    for thread in (first, waiter, late):
        thread.join(10)
    assert events == ["first in", "second in", "first out", "alone in", "alone out", "late in", "late out"]
