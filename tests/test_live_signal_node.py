"""A real site node reads its intensity from a live feed over HTTP and survives the feed's outages.

The feed is the Electricity Maps v3 API, served on 127.0.0.1 by :class:`tests.grid_api.ReplayedApi`
from a day of GB's 2023 export (day 86, threshold 120 gCO2/kWh: windows 03-05, 09-16 and 22-24 h),
replayed at 1800x. The API fails twelve ways, by clock time (hours; * inside a window, where
hold-last keeps the site training):

    00:12-00:30 HTTP 429 (Retry-After: 0)   09:30-10:12* JSON without carbonIntensity
    01:12-01:54 HTTP 500                    10:36-11:18* timestamps three days back
    03:18-04:00* HTTP 401                   12:12-13:06* an HTML error page
    05:48-06:30 JSON cut short              13:30-14:12* timestamps three days ahead
    06:48-08:24 HTTP 503                    16:30-17:54  no answer within the timeout
                                            19:00-20:00  null values
                                            20:18-21:00  HTTP 404, unknown zone

The node must enter and leave the windows the file gives, stay in its window through the outages
inside them, say each outage in one line without a traceback or the token (and one when the feed is
back), and end with exactly the file's windows in its summary (what it missed during outages is
filled in from ``history``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from greenswarm.scheduler.clock import ReplayClock
from greenswarm.scheduler.policy import ThresholdPolicy, WindowSchedule
from greenswarm.timefmt import iso_utc, parse_iso
from greenswarm.traces import load_trace
from greenswarm.traces.trace import Trace
from tests._shared import shared_path
from tests.conftest import Swarm, site_config
from tests.grid_api import EM_TOKEN, ReplayedApi, api_server

pytestmark = [pytest.mark.signals, pytest.mark.swarm, pytest.mark.shared]

ZONE, DAY, THRESHOLD = "GB", 86, 120.0
SPEEDUP = 1800.0
HOUR = 3600.0
OUTAGES_H = [
    (0.2, 0.5, "rate-limited"),
    (1.2, 1.9, "http 500"),
    (3.3, 4.0, "refused"),
    (5.8, 6.5, "truncated"),
    (6.8, 8.4, "http 503"),
    (9.5, 10.2, "missing field"),
    (10.6, 11.3, "backwards"),
    (12.2, 13.1, "html"),
    (13.5, 14.2, "future"),
    (16.5, 17.9, "slow"),  # both tries (a timeout is an hour of clock time) fall inside
    (19.0, 20.0, "nan"),
    (20.3, 21.0, "unknown area"),
]
#: what the one line about each says
SAID = {
    "rate-limited": "HTTP 429",
    "http 500": "HTTP 500",
    "refused": "credentials refused",
    "truncated": "not JSON",
    "http 503": "HTTP 503",
    "missing field": "expected 'datetime' and 'carbonIntensity'",
    "backwards": "older than",
    "html": "not JSON",
    "future": "stamped after now",
    "slow": "no answer",
    "nan": "NaN, missing or negative",
    "unknown area": "HTTP 404",
}
EDGE_S = 1800.0  # a transition may lag its window edge by a poll (300 s) and a training step or two
TRANSITION = re.compile(r"(IDLE|SOLO|FEDERATED) -> (IDLE|SOLO|FEDERATED) at (\S+ \S+Z)")


def _hours(n: int) -> Trace:
    """``n`` hours of GB's 2023 export from the start of day :data:`DAY`."""
    full = load_trace(str(shared_path("traces/electricitymaps-2023/GB_2023_hourly.csv")))
    span = slice(DAY * 24, DAY * 24 + n)
    return Trace.from_columns(full.times[span], {ZONE: full.series(ZONE)[span]}, f"GB 2023 day {DAY}")


def test_node_follows_a_live_feed_over_http_through_its_outages(swarm: Swarm, tmp_path: Path) -> None:
    trace = _hours(24)  # what the node runs through; the API has two hours more, as a live one would
    expected = WindowSchedule(trace, ZONE, ThresholdPolicy(THRESHOLD)).windows
    assert [((w.start - trace.start) / HOUR, (w.end - trace.start) / HOUR) for w in expected] == [
        (3, 5), (9, 16), (22, 24)
    ]  # fmt: skip
    start_file = tmp_path / "start"
    clock = ReplayClock(trace.start, SPEEDUP, start_file=start_file)
    with api_server() as server:
        # (a replay's clock stands a little before its start until then; a live API has a latest anyway)
        api = ReplayedApi(server, _hours(26), ZONE, lambda: max(clock.now(), trace.start))
        api.retry_after_s, api.slow_s = 0, 2.5
        api.timetable = [(trace.start + a * HOUR, trace.start + b * HOUR, f) for a, b, f in OUTAGES_H]
        peers = swarm.bootstrap()
        cfg = site_config(
            "live", ZONE, tmp_path / "unused.csv", peers, tmp_path / "live", speedup=SPEEDUP,
            start_file=start_file, sync_s=2 * HOUR,
            scheduler={
                "trace": "builtin",
                "threshold": THRESHOLD,
                "poll_s": 300.0,
                "on_signal_loss": "hold-last",
                "max_staleness_s": 3 * HOUR,
                "signal": {
                    "kind": "electricitymaps", "zone": ZONE, "base_url": api.url, "token_env": "GS_EM_TOKEN",
                    "poll_s": 300.0, "timeout_s": 2.0, "retries": 1, "backoff_s": 0.05,
                },
            },
            node={"stop_at": iso_utc(trace.end), "log_every_s": 30.0},
        )  # fmt: skip
        cfg["scheduler"]["clock"]["start"] = iso_utc(trace.start)
        swarm.node("live", swarm.write_config("live", cfg), env={"GS_EM_TOKEN": EM_TOKEN})
        swarm.start_replay(["live"], start_file, lead_s=0.01)  # (the API and the node agree on the time)
        assert swarm.wait("live", timeout=24 * HOUR / SPEEDUP + 120) == 0, swarm.log("live")[-3000:]

    log = swarm.log("live")
    summary = json.loads((tmp_path / "live" / "summary.json").read_text())
    files = "".join(
        p.read_text(errors="replace")
        for p in (tmp_path / "live").rglob("*")
        if p.suffix in (".json", ".jsonl")
    )
    assert "Traceback" not in log
    assert EM_TOKEN not in log + files

    # each outage said once, as a warning naming the feed and what the site does
    said = [line for line in log.splitlines() if " W " in line and "signal electricitymaps GB" in line]
    assert len(said) == len(OUTAGES_H), said
    for line, (_, _, what) in zip(said, OUTAGES_H, strict=True):
        assert SAID[what] in line
        assert "hold-last" in line
    assert log.count("back after") == len(OUTAGES_H)

    # the windows the node decided on are the file's, to the second
    signal = summary["signal"]
    assert signal["outages"] == len(OUTAGES_H) and signal["failed_polls"] >= len(OUTAGES_H)
    got = [tuple(w) for w in signal["windows"] if w[1] <= trace.times[-1]]
    assert got == [(w.start, w.end) for w in expected if w.end <= trace.times[-1]]

    # it entered and left them as the feed said, within a poll and a step, and trained through the
    # outage inside the second window (hold-last)
    moves = [(a, b, parse_iso(t.replace(" ", "T"))) for a, b, t in TRANSITION.findall(log)]
    entries = [t for a, b, t in moves if a == "IDLE"]
    exits = [t for a, b, t in moves if b == "IDLE" and t < trace.end - 60]
    assert len(entries) == 3 and len(exits) == 2, moves
    np.testing.assert_array_less(np.abs(np.array(entries) - [w.start for w in expected]), EDGE_S)
    np.testing.assert_array_less(np.abs(np.array(exits) - [w.end for w in expected[:2]]), EDGE_S)
    assert summary["local_steps"] > 0 and summary["emissions_g"] > 0
