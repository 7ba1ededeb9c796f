"""``train.max_steps_per_s``: the pause after a step, a stop that ends it, and the config's check.

In-process, with the real :class:`StepPace` and a real :class:`threading.Event`; the swarm tests run
their sites under the cap (``TEST_STEPS_PER_S`` in tests/conftest.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from greenswarm.errors import ConfigError
from greenswarm.node.config import load_site_config
from greenswarm.node.pacing import StepPace


def test_steps_are_spaced_by_the_cap_and_a_slow_step_waits_for_nothing() -> None:
    pace, stop = StepPace(20.0), threading.Event()
    began = time.monotonic()
    pace.pause(began, stop)
    assert time.monotonic() - began >= 0.05  # 1/20 s from the step's start
    slow = time.monotonic() - 0.2  # a step that took longer than its interval
    before = time.monotonic()
    pace.pause(slow, stop)
    assert time.monotonic() - before < 0.01 and pace.paused_s < 0.06


def test_no_cap_never_pauses() -> None:
    pace = StepPace(0.0)
    assert pace.interval_s == 0.0
    before = time.monotonic()
    pace.pause(before, threading.Event())
    assert time.monotonic() - before < 0.01


def test_a_stop_request_ends_the_pause_at_once() -> None:
    """A stop (a signal handler sets the node's stop event) must not wait out a long interval."""
    pace, stop = StepPace(0.01), threading.Event()  # a step every 100 s
    threading.Timer(0.1, stop.set).start()
    before = time.monotonic()
    pace.pause(before, stop)
    assert time.monotonic() - before < 5.0


@pytest.mark.parametrize("value", ["-1", ".nan", ".inf"])
def test_the_cap_must_be_a_finite_rate(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_site_config(None, ["name=x", "region=R", f"train.max_steps_per_s={value}"])
    assert "train.max_steps_per_s" in str(info.value) and "must be >= 0" in str(info.value)


def test_the_cap_loads_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "site.yaml"
    path.write_text("name: s\nregion: DE\ntrain:\n  max_steps_per_s: 2.5\n")
    assert load_site_config(path).train.max_steps_per_s == 2.5
