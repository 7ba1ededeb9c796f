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


class RecordingStop(threading.Event):
    """A stop event that records how long each pause asked to wait (no wall-clock bounds to flake)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return super().wait(0)


def test_steps_are_spaced_by_the_cap_and_a_slow_step_waits_for_nothing() -> None:
    pace, stop = StepPace(20.0), RecordingStop()
    began = time.monotonic()
    pace.pause(began, stop)  # a step that took no time: the whole interval is left
    assert len(stop.waits) == 1 and 0.04 < stop.waits[0] <= 0.05
    pace.pause(time.monotonic() - 0.2, stop)  # a step longer than its interval: no pause at all
    assert len(stop.waits) == 1


def test_no_cap_never_pauses() -> None:
    pace, stop = StepPace(0.0), RecordingStop()
    pace.pause(time.monotonic(), stop)
    assert pace.interval_s == 0.0 and stop.waits == []


def test_a_stop_request_ends_the_pause_at_once() -> None:
    """The pause waits on the node's stop event (a signal handler sets it), so a stop does not wait
    out a long interval: here a step every 1000 s, and a stop already requested."""
    pace, stop = StepPace(0.001), threading.Event()
    stop.set()
    before = time.monotonic()
    pace.pause(before, stop)
    assert time.monotonic() - before < 100  # (not the 1000 s interval)


@pytest.mark.parametrize("value", ["-1", ".nan", ".inf"])
def test_the_cap_must_be_a_finite_rate(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_site_config(None, ["name=x", "region=R", f"train.max_steps_per_s={value}"])
    assert "train.max_steps_per_s" in str(info.value) and "must be >= 0" in str(info.value)


def test_the_cap_loads_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "site.yaml"
    path.write_text("name: s\nregion: DE\ntrain:\n  max_steps_per_s: 2.5\n")
    assert load_site_config(path).train.max_steps_per_s == 2.5
