"""A live feed: polls a signal source on its own thread, checks what arrives, keeps what was observed.

The node never waits on the network: it reads :meth:`LiveFeed.observed`, the samples seen so far, and
the feed's thread does the polling, every ``poll_s`` of clock time (or later, when the server asked
for that with ``Retry-After``).

What a poll brings is checked before it is believed. Values that are NaN, missing or negative are
dropped; samples stamped in the future (a skewed clock) are dropped; a feed whose newest sample is
older than one already seen (timestamps going backwards) adds nothing; a sample already seen is
never revised (the node decided on the first value; later revisions of estimates change nothing it
did). A failure -- the feed down, slow, an HTTP error, malformed or truncated JSON, an unknown zone --
or bad data is said in *one* log line when it starts, with what the site does about it, and once
more when the feed is back; the same failure again is not repeated. Nothing here raises into the
node, and nothing logs a traceback.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from greenswarm.signals.errors import FeedError
from greenswarm.signals.sources import Reading, SignalSource
from greenswarm.timefmt import utc_minute
from greenswarm.traces.forecast_file import Issue
from greenswarm.traces.trace import median_resolution

#: a sample may be stamped this far after the site's clock (clocks differ a little) and still be used
FUTURE_SKEW_S = 60.0
#: how much observed history a feed keeps (the window rules look back a day or two at most)
RETENTION_S = 8 * 86400.0


@dataclass(frozen=True)
class Observed:
    """What a feed has observed: samples (read-only), the newest forecast, and a version that changes
    whenever either does."""

    times: np.ndarray
    values: np.ndarray
    resolution_s: float
    forecast: Issue | None
    version: int

    @property
    def empty(self) -> bool:
        return self.times.size == 0

    @property
    def covered_until(self) -> float:
        """The end of what the samples say: the last one covers one resolution step."""
        return -math.inf if self.empty else float(self.times[-1]) + self.resolution_s


@dataclass
class FeedStats:
    """Counters for the node's summary."""

    polls: int = 0
    failed_polls: int = 0
    outages: int = 0
    dropped_values: int = 0
    samples: int = 0
    failures: dict[str, int] = field(default_factory=dict)


def _frozen(array: np.ndarray) -> np.ndarray:
    array = np.array(array, dtype=np.float64)
    array.setflags(write=False)
    return array


class LiveFeed:
    """Polls ``source`` every ``poll_s`` seconds of ``now()`` time (``wall_s`` converts clock seconds to
    wall seconds for a replay). ``on_loss``: the words that say what the site does while the feed
    fails (the schedule's policy), appended to the line that reports a failure."""

    def __init__(
        self,
        source: SignalSource,
        now: Callable[[], float],
        poll_s: float,
        log: logging.Logger,
        *,
        wall_s: Callable[[float], float] = lambda s: s,
        on_loss: str = "",
        retention_s: float = RETENTION_S,
    ):
        self.source, self.now, self.poll_s, self.log = source, now, float(poll_s), log
        self.wall_s, self.on_loss, self.retention_s = wall_s, on_loss, retention_s
        self.stats = FeedStats()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._observed = Observed(_frozen([]), _frozen([]), source.resolution_s, None, 0)
        self._trouble: str | None = None  # the kind of the failure in progress
        self._trouble_since = 0.0
        self._failed_in_trouble = 0
        self._next_wait_s: float | None = None
        self._first = threading.Event()  # set once the first poll is done
        self._forecast_trouble: str | None = None

    # ------------------------------------------------------------------ reading

    def observed(self) -> Observed:
        with self._lock:
            return self._observed

    # ------------------------------------------------------------------ polling

    def start(self, first_wait_s: float = 5.0) -> None:
        """Poll on a thread from now on, and wait up to ``first_wait_s`` wall seconds for the first
        answer (so a site starts with data when the feed is up, and without it when it is not)."""
        self._thread = threading.Thread(target=self._run, name="signal-feed", daemon=True)
        self._thread.start()
        self._first.wait(first_wait_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self.source.close()

    def _run(self) -> None:
        self.poll()
        self._first.set()
        while not self._stop.is_set():
            wait = self.wall_s(self.poll_s)
            if self._next_wait_s is not None:
                wait, self._next_wait_s = max(wait, self._next_wait_s), None
            if self._stop.wait(wait):
                return
            self.poll()

    def poll(self) -> bool:
        """Read the source once; whether it answered with usable data. Never raises."""
        asked = self.now()
        self.stats.polls += 1
        since = None if self._observed.empty else float(self._observed.times[-1])
        try:
            reading = self.source.read(since, asked)
            problem = self._accept(reading, asked, max(asked, self.now()))
        except FeedError as err:
            self._next_wait_s = err.retry_after_s
            self._failed(err.kind, str(err))
            return False
        except Exception as err:  # a source's own bug must not stop the site: say it, in one line
            self._failed("error", f"{type(err).__name__}: {err}")
            return False
        self._forecast_state(reading)
        if problem is not None:
            self._failed(*problem)
            return False
        self._recovered()
        return True

    def _forecast_state(self, reading: Reading) -> None:
        """A forecast that failed costs the poll nothing: said once, and once when it is back."""
        err = reading.forecast_error
        if err is not None and err.kind != self._forecast_trouble and not self._stop.is_set():
            self.log.warning(
                "signal %s: no forecast: %s; the realized signal is unaffected", self.source.name, err
            )
        elif err is None and self._forecast_trouble is not None and reading.forecast is not None:
            self.log.info("signal %s: forecast back", self.source.name)
        self._forecast_trouble = None if err is None else err.kind

    def _accept(self, reading: Reading, asked: float, now: float) -> tuple[str, str] | None:
        """Merge a reading into what was observed; the (kind, message) of a problem with it, if any.

        Its samples are judged at ``now``, when the answer came: a slow one may carry samples stamped
        after the ask. Whether a new sample was due, at ``asked``: the feed answered with what it had
        somewhere between the two, so a slow answer to an ask made before the next sample was due is
        no missing sample (on a loaded machine a replay at 1,800x called one so: an ask just before
        the sample, answered more than a poll, 0.17 wall s, later; row 87 of docs/testing.md)."""
        times, values = np.asarray(reading.times, np.float64), np.asarray(reading.values, np.float64)
        problems: list[tuple[str, str]] = []
        good = np.isfinite(values) & (values >= 0) & np.isfinite(times)
        if not good.all():
            dropped = int((~good).sum())
            self.stats.dropped_values += dropped
            problems.append(("bad values", f"dropped {dropped} NaN, missing or negative value(s)"))
        future = times > now + FUTURE_SKEW_S
        if (good & future).any():
            count = int((good & future).sum())
            self.stats.dropped_values += count
            problems.append(
                ("future samples", f"dropped {count} sample(s) stamped after now (a skewed clock?)")
            )
        keep = good & ~future
        times, values = times[keep], values[keep]
        order = np.argsort(times, kind="stable")
        times, values = times[order], values[order]
        if times.size:  # a repeated instant within one answer: the later row wins
            last = np.append(np.diff(times) > 0, True)
            times, values = times[last], values[last]
        old = self._observed
        newest = float(old.times[-1]) if not old.empty else -math.inf
        fresh = times > newest
        if times.size and not fresh.any() and times[-1] < newest:
            problems.append(
                (
                    "time went backwards",
                    f"newest sample {_stamp(times[-1])} is older than {_stamp(newest)}, seen before",
                )
            )
        forecast = old.forecast
        issue = _checked(reading.forecast)
        if issue is not None and (forecast is None or issue.generated_at >= forecast.generated_at):
            forecast = issue
        if fresh.any() or forecast is not old.forecast:
            keep_from = now - self.retention_s
            all_t = np.concatenate([old.times, times[fresh]])
            all_v = np.concatenate([old.values, values[fresh]])
            first = min(int(np.searchsorted(all_t, keep_from)), max(all_t.size - 1, 0))
            self.stats.samples += int(fresh.sum())
            # the samples' own spacing (a source's nominal one is only a guess until two have come)
            resolution = median_resolution(all_t) if all_t.size >= 2 else self.source.resolution_s
            with self._lock:
                self._observed = Observed(
                    _frozen(all_t[first:]), _frozen(all_v[first:]), resolution, forecast, old.version + 1
                )
        if not problems and not fresh.any() and asked >= old.covered_until + self.poll_s:
            if self._observed.empty:
                problems.append(("empty", "no samples yet"))
            else:  # the feed answers, but with nothing after the sample it gave an interval and a poll ago
                problems.append(("no new data", f"no sample after {_stamp(newest)}"))
        return problems[0] if problems else None

    def _failed(self, kind: str, message: str) -> None:
        if self._stop.is_set():  # a request cut short by stop() is no outage
            return
        self.stats.failed_polls += 1
        self.stats.failures[kind] = self.stats.failures.get(kind, 0) + 1
        if self._trouble is None:
            self.stats.outages += 1
            self._trouble_since, self._failed_in_trouble = time.monotonic(), 0
        self._failed_in_trouble += 1
        if kind == self._trouble:
            self.log.debug("signal %s: %s (again)", self.source.name, message)
            return
        self._trouble = kind
        then = f"; {self.on_loss}" if self.on_loss else ""
        self.log.warning("signal %s: %s%s", self.source.name, message, then)

    def _recovered(self) -> None:
        if self._trouble is None:
            return
        self.log.info(
            "signal %s back after %d failed poll(s) over %.0f s",
            self.source.name, self._failed_in_trouble, time.monotonic() - self._trouble_since,
        )  # fmt: skip
        self._trouble = None

    @property
    def failing(self) -> str | None:
        """The kind of the failure in progress (None while the feed answers)."""
        return self._trouble


def _checked(issue: Issue | None) -> Issue | None:
    """A forecast without its NaN, missing or negative points (None when nothing is left): a bad
    forecast value must not stand in for the signal."""
    if issue is None:
        return None
    times, values = np.asarray(issue.times, np.float64), np.asarray(issue.values, np.float64)
    good = np.isfinite(times) & np.isfinite(values) & (values >= 0)
    if not good.any():
        return None
    order = np.argsort(times[good], kind="stable")
    return Issue(issue.generated_at, times[good][order], values[good][order])


def _stamp(t: float) -> str:
    return utc_minute(float(t))
