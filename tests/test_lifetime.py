"""simulator/lifetime.py: a command-line run keeps its objects until exit; library callers release them."""

from __future__ import annotations

import gc
import weakref

from simulator import lifetime


class _Thing:
    pass


def test_keep_holds_nothing_unless_a_command_line_run_asked(monkeypatch):
    monkeypatch.setattr(lifetime, "_kept", None)
    thing = _Thing()
    alive = weakref.ref(thing)
    lifetime.keep(thing)
    del thing
    gc.collect()
    assert alive() is None


def test_keep_until_exit_holds_what_keep_is_given(monkeypatch):
    monkeypatch.setattr(lifetime, "_kept", None)
    lifetime.keep_until_exit()
    thing = _Thing()
    alive = weakref.ref(thing)
    lifetime.keep(thing)
    del thing
    gc.collect()
    assert alive() is not None
