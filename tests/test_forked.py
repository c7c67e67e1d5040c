"""simulator/forked.py: work done in forked processes gives what doing it here gives; failures are computed here."""

from __future__ import annotations

import os
import signal
import time

import pytest

from simulator.forked import Forked, Unanswered, fork_map, fork_safe

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")


def _square_with_pid(x: int) -> tuple[int, int]:
    return x * x, os.getpid()


def _fails_off_the_parent(x: int, parent: int) -> int:
    if os.getpid() != parent:
        raise ValueError(f"not here: {x}")
    return -x


def test_fork_map_gives_the_list_in_order_and_forks_where_it_is_safe():
    items = list(range(7))
    out = fork_map(_square_with_pid, (x for x in items), 3)      # a generator: each item forked as it comes
    assert [value for value, _ in out] == [x * x for x in items]
    pids = [pid for _, pid in out]
    if fork_safe():
        assert os.getpid() not in pids and len(set(pids)) == len(items)
    else:
        assert set(pids) == {os.getpid()}


def test_a_child_that_raises_has_its_items_computed_here():
    parent = os.getpid()
    assert fork_map(lambda x: _fails_off_the_parent(x, parent), [1, 2, 3, 4], 2) == [-1, -2, -3, -4]


def test_a_job_that_raises_or_dies_is_unanswered():
    with pytest.raises(Unanswered):
        Forked(_fails_off_the_parent, 1, os.getpid()).result()
    with pytest.raises(Unanswered):
        Forked(os._exit, 3).result()
    assert Forked(_square_with_pid, 5).result()[0] == 25


def _sleep_with_a_grandchild(path: str) -> None:
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    with open(path, "w") as f:
        f.write(str(pid))
    time.sleep(30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_cancel_stops_the_child_and_what_it_forked(tmp_path):
    path = tmp_path / "grandchild"
    job = Forked(_sleep_with_a_grandchild, str(path), own_group=True)
    child = job.pid
    for _ in range(500):
        if path.exists() and path.read_text():
            break
        time.sleep(0.01)
    grandchild = int(path.read_text())
    job.cancel()
    assert not _alive(child)
    for _ in range(500):              # reparented to init, reaped there
        if not _alive(grandchild):
            break
        try:
            os.waitpid(grandchild, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.01)
    if _alive(grandchild):
        os.kill(grandchild, signal.SIGKILL)
        pytest.fail("the grandchild outlived cancel")
    with pytest.raises(Unanswered):
        job.result()
