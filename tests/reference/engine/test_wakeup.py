"""``kvbridge.reference.engine.wakeup``: set, clear and wait, across threads and processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import threading

import pytest

from kvbridge.reference.engine.wakeup import Wakeup, WakeupSender


def test_set_clear_wait() -> None:
    flag = Wakeup()
    try:
        assert not flag.wait(0.0)
        flag.set()
        flag.set()
        assert flag.wait(0.0) and flag.wait(0.0)  # waiting consumes nothing
        flag.clear()
        assert not flag.wait(0.0)
    finally:
        flag.close()


def test_many_sets_never_block() -> None:
    flag = Wakeup()
    try:
        for _ in range(200_000):  # far more than a pipe holds
            flag.set()
        assert flag.wait(0.0)
        flag.clear()
        assert not flag.wait(0.0)
    finally:
        flag.close()


def test_a_thread_wakes_the_waiter() -> None:
    flag = Wakeup()
    sender = flag.sender()
    try:
        timer = threading.Timer(0.05, sender)
        timer.start()
        assert flag.wait(10.0)
        timer.join()
    finally:
        sender.close()
        flag.close()


def _poke(sender: WakeupSender) -> None:
    sender()


def test_a_spawned_process_wakes_the_waiter() -> None:
    flag = Wakeup()
    try:
        child = mp.get_context("spawn").Process(target=_poke, args=(flag.sender(),))
        child.start()
        assert flag.wait(30.0)
        child.join(30.0)
        assert child.exitcode == 0
    finally:
        flag.close()


def test_closed_flag_ignores_sets_and_does_not_block() -> None:
    flag = Wakeup()
    sender = flag.sender()
    flag.close()
    flag.set()
    sender()  # the read end is gone: EPIPE is swallowed
    flag.clear()
    assert flag.wait(5.0)  # at once: nothing can set a closed flag
    flag.close()
    sender.close()


def test_a_flag_on_descriptors_above_1024_still_waits() -> None:
    """A process with many files open (an engine serving many clients) gets pipe ends
    from 1024 up, where ``select`` refuses to wait: the flag must not care."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    spare = []
    try:
        while (fd := os.dup(0 if os.path.exists("/proc/self/fd/0") else 1)) < 1030:
            spare.append(fd)
        os.close(fd)
        flag = Wakeup()
        try:
            assert flag._read_fd >= 1024
            assert not flag.wait(0.01)
            flag.set()
            assert flag.wait(1.0)
        finally:
            flag.close()
    finally:
        for fd in spare:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
