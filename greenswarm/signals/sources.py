"""Signal sources: one zone's intensity samples after ``since`` and up to ``now``, from wherever.

Every source returns a :class:`Reading` in gCO2/kWh, stamped at the start of the interval each value
covers (hold-last, as traces are). A source only fetches and parses; checking values, dropping
repeats and logging are the feed's (:mod:`greenswarm.signals.feed`), so each source stays a thin
translation of one API's shapes.

* :class:`TraceSignal` replays a loaded trace by the clock (nothing after ``now`` is visible);
* :class:`FileSignal` re-reads a trace file when its size or modification time changes;
* :class:`ElectricityMapsSignal`: ``/v3/carbon-intensity/{latest,history,forecast,past-range}``;
* :class:`WattTimeSignal`: ``/login`` then ``/v3/{historical,forecast}``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from greenswarm.configuration import config_from_dict
from greenswarm.errors import ConfigError, GreenswarmError
from greenswarm.signals.config import DEFAULT_BASE_URL, DEFAULT_TOKEN_ENV, SignalConfig
from greenswarm.signals.errors import FeedError
from greenswarm.signals.http import JsonClient
from greenswarm.timefmt import iso_utc, parse_iso
from greenswarm.traces.forecast_file import Issue
from greenswarm.traces.readers import UNITS
from greenswarm.traces.trace import Trace

#: Electricity Maps publishes one value per hour
EM_RESOLUTION_S = 3600.0
#: WattTime's MOER comes every 5 minutes
WATTTIME_RESOLUTION_S = 300.0
#: longest range one Electricity Maps past-range request may cover (hourly data)
EM_RANGE_S = 10 * 86400.0
#: longest range one WattTime historical request may cover
WATTTIME_RANGE_S = 30 * 86400.0
#: a WattTime login token lives 30 minutes; renew it a little before
WATTTIME_TOKEN_S = 25 * 60.0
#: WattTime's units, as the trace readers name them
WATTTIME_UNITS = {"lbs_co2_per_mwh": "lbs/MWh", "g_co2_per_kwh": "g/kWh", "kg_co2_per_kwh": "kg/kWh"}


@dataclass
class Reading:
    """What one poll brought: realized samples (start instants and g/kWh values, in the order the
    source gave them; the feed checks them) and, when asked for, the forecast issued with them --
    or why there is none (a forecast that fails costs the poll nothing else)."""

    times: np.ndarray
    values: np.ndarray
    forecast: Issue | None = None
    forecast_error: FeedError | None = None

    @classmethod
    def of(cls, pairs: list[tuple[float, float]], forecast: Issue | None = None) -> Reading:
        times = np.array([t for t, _ in pairs], dtype=np.float64)
        values = np.array([v for _, v in pairs], dtype=np.float64)
        return cls(times, values, forecast)


class SignalSource(Protocol):
    """One zone's intensity, polled."""

    #: what logs call this source (kind, area, host; never a secret)
    name: str
    #: the spacing of its samples
    resolution_s: float
    #: the last instant it can ever have data for (a replayed trace's end; inf for live feeds)
    end: float

    def read(self, since: float | None, now: float) -> Reading:
        """Samples after ``since`` (all there are when None) up to ``now``, and a forecast when asked."""
        ...

    def history(self, start: float, end: float) -> Trace:
        """The realized signal over ``[start, end)`` (for ``windows`` and ``simulate``)."""
        ...

    def close(self) -> None: ...


def _until(trace: Trace, region: str, since: float | None, now: float) -> Reading:
    """The samples of ``trace`` after ``since`` and at or before ``now``."""
    lo = 0 if since is None else int(np.searchsorted(trace.times, since, side="right"))
    hi = int(np.searchsorted(trace.times, now, side="right"))
    return Reading(np.array(trace.times[lo:hi]), np.array(trace.series(region)[lo:hi]))


class TraceSignal:
    """A loaded trace, revealed by the clock: at ``now`` only samples stamped at or before ``now``."""

    def __init__(self, trace: Trace, region: str):
        trace.series(region)
        self.trace, self.region = trace, region
        self.name = f"trace {trace.source}"
        self.resolution_s = trace.resolution_s
        self.end = trace.end

    def read(self, since: float | None, now: float) -> Reading:
        return _until(self.trace, self.region, since, now)

    def history(self, start: float, end: float) -> Trace:
        return self.trace

    def close(self) -> None:
        pass


class FileSignal:
    """A trace file that something else keeps current: re-read (whole, with the site's reader options)
    whenever its size or modification time changes. A rewrite caught half-way fails to parse; the
    feed reports that as bad data and the next poll reads the finished file."""

    def __init__(self, path: str, region: str, load: Callable[[str], Trace]):
        self.path, self.region, self.load = path, region, load
        self.name = f"file {path}"
        self.end = math.inf
        self._stamp: tuple[int, int] | None = None
        self._trace: Trace | None = None
        self.resolution_s = self._current().resolution_s

    def _current(self) -> Trace:
        try:
            info = os.stat(self.path)
        except OSError as err:
            raise FeedError("unreachable", f"cannot read {self.path}: {err.strerror}") from None
        stamp = (info.st_mtime_ns, info.st_size)
        if self._trace is None or stamp != self._stamp:
            try:
                trace = self.load(self.path)
                trace.series(self.region)
            except GreenswarmError as err:
                raise FeedError("malformed", str(err)) from None
            self._trace, self._stamp = trace, stamp
            self.resolution_s = trace.resolution_s
        return self._trace

    def read(self, since: float | None, now: float) -> Reading:
        return _until(self._current(), self.region, since, now)

    def history(self, start: float, end: float) -> Trace:
        return self._current()

    def close(self) -> None:
        pass


def _number(value: Any, where: str) -> float:
    """A JSON number (null is a missing value: NaN, which the feed drops and reports)."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FeedError("malformed", f"{where}: expected a number, got {type(value).__name__}")
    return float(value)


def _instant(value: Any, where: str) -> float:
    if not isinstance(value, str):
        raise FeedError("malformed", f"{where}: expected an ISO 8601 time, got {type(value).__name__}")
    try:
        return parse_iso(value)
    except ValueError:
        raise FeedError(
            "malformed", f"{where}: cannot read time {value[:40]!r} (needs a UTC offset)"
        ) from None


def _points(
    rows: Any, time_key: str, value_key: str, where: str, factor: float = 1.0
) -> list[tuple[float, float]]:
    """``[(t, value * factor)]`` from a JSON list of objects."""
    if not isinstance(rows, list):
        raise FeedError("malformed", f"{where}: expected a list, got {type(rows).__name__}")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or time_key not in row or value_key not in row:
            raise FeedError("malformed", f"{where}[{i}]: expected {time_key!r} and {value_key!r}")
        out.append(
            (
                _instant(row[time_key], f"{where}[{i}].{time_key}"),
                _number(row[value_key], f"{where}[{i}]") * factor,
            )
        )
    return out


def _field(body: Any, key: str, where: str) -> Any:
    if not isinstance(body, dict) or key not in body:
        raise FeedError("malformed", f"{where}: no {key!r} in the answer")
    return body[key]


def _client(cfg: SignalConfig, secrets: list[str]) -> JsonClient:
    return JsonClient(
        cfg.url,
        timeout_s=cfg.timeout_s,
        retries=cfg.retries,
        backoff_s=cfg.backoff_s,
        max_retry_after_s=min(cfg.poll_s, 300.0),
        secrets=secrets,
    )


def _chunks(start: float, end: float, size: float) -> list[tuple[float, float]]:
    edges = list(np.arange(start, end, size)) + [end]
    return [(float(a), float(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


class ElectricityMapsSignal:
    """The Electricity Maps v3 API for one zone.

    A first poll (or one after a gap) reads ``history`` (the last 24 h), later polls ``latest``;
    ``forecast`` when asked; ``past-range`` for a period. ``variant`` picks the emission factor
    (``direct`` or life-cycle), as for Electricity Maps exports.
    """

    def __init__(self, cfg: SignalConfig, variant: str = "direct"):
        self.cfg = cfg
        cfg.token_env = cfg.token_env or DEFAULT_TOKEN_ENV["electricitymaps"]
        token = cfg.secret("token_env")
        self.client = _client(cfg, [token])
        self.headers = {"auth-token": token}
        self.zone = cfg.area
        self.factor = "direct" if variant.strip().lower() == "direct" else "lifecycle"
        self.name = cfg.describe()
        self.resolution_s = EM_RESOLUTION_S
        self.end = math.inf

    def _get(self, what: str, **params: Any) -> Any:
        query = {"zone": self.zone, "emissionFactorType": self.factor, **params}
        return self.client.get(f"/v3/carbon-intensity/{what}", params=query, headers=self.headers)

    def read(self, since: float | None, now: float) -> Reading:
        pairs = None
        if since is not None and now - since < 2 * self.resolution_s:
            pairs = _points([self._get("latest")], "datetime", "carbonIntensity", "latest")
            if pairs[0][0] > since + 1.5 * self.resolution_s:
                pairs = None  # latest skips an interval (one we dropped as bad, say): history fills it
        if pairs is None:
            body = self._get("history")
            pairs = _points(_field(body, "history", "history"), "datetime", "carbonIntensity", "history")
        return _with_forecast(Reading.of(pairs), self._forecast, now, self.cfg.forecast)

    def _forecast(self, now: float) -> Issue:
        body = self._get("forecast")
        pairs = _points(_field(body, "forecast", "forecast"), "datetime", "carbonIntensity", "forecast")
        issued = (
            _instant(body["updatedAt"], "forecast.updatedAt")
            if isinstance(body.get("updatedAt"), str)
            else now
        )
        return Issue(min(issued, now), *_issue_arrays(pairs))

    def history(self, start: float, end: float) -> Trace:
        pairs: list[tuple[float, float]] = []
        for a, b in _chunks(start, end, EM_RANGE_S):
            body = self._get("past-range", start=iso_utc(a), end=iso_utc(b))
            pairs += _points(_field(body, "data", "past-range"), "datetime", "carbonIntensity", "past-range")
        return _trace(pairs, self.zone, self.name)

    def close(self) -> None:
        self.client.close()


def _with_forecast(reading: Reading, fetch: Callable[[float], Issue], now: float, wanted: bool) -> Reading:
    """``reading`` with the forecast fetched now, or the reason it could not be."""
    if wanted:
        try:
            reading.forecast = fetch(now)
        except FeedError as err:
            reading.forecast_error = err
    return reading


def _issue_arrays(pairs: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    reading = Reading.of(sorted(pairs))
    return reading.times, reading.values


def _trace(pairs: list[tuple[float, float]], region: str, source: str) -> Trace:
    """A trace from fetched pairs: sorted, repeats dropped, bad values refused by Trace itself."""
    if not pairs:
        raise FeedError("empty", f"{source}: no data in the range asked for")
    times, values = _issue_arrays(sorted(dict(pairs).items()))
    return Trace.from_columns(times, {region: values}, source)


class WattTimeSignal:
    """The WattTime v3 API for one region and signal type (``co2_moer`` by default).

    Authentication: a bearer token from ``token_env`` when set, otherwise a login (HTTP basic auth
    with the user and password from ``user_env``/``password_env``) whose token is renewed every 25
    minutes and after a 401. Data: ``/v3/historical`` from the last sample on, ``/v3/forecast`` when
    asked. Values arrive in ``meta.units`` (lbs/MWh) and are converted to g/kWh.
    """

    def __init__(self, cfg: SignalConfig):
        self.cfg = cfg
        self.fixed_token = cfg.secret("token_env") if cfg.token_env else None
        self.login = None if self.fixed_token else (cfg.secret("user_env"), cfg.secret("password_env"))
        self.client = _client(cfg, [self.fixed_token or "", self.login[1] if self.login else ""])
        self.region, self.signal_type = cfg.area, cfg.signal_type
        self.name = cfg.describe()
        self.resolution_s = WATTTIME_RESOLUTION_S
        self.end = math.inf
        self._token: str | None = self.fixed_token
        self._token_until = math.inf if self.fixed_token else 0.0

    def _bearer(self) -> str:
        if self._token is None or time.monotonic() >= self._token_until:
            assert self.login is not None
            body = self.client.get("/login", auth=self.login)
            token = body.get("token") if isinstance(body, dict) else None
            if not isinstance(token, str) or not token:
                raise FeedError("refused", "/login: no token in the answer")
            self.client.add_secret(token)
            self._token, self._token_until = token, time.monotonic() + WATTTIME_TOKEN_S
        return self._token

    def _get(self, path: str, **params: Any) -> Any:
        query = {"region": self.region, "signal_type": self.signal_type, **params}
        for attempt in (0, 1):
            try:
                return self.client.get(
                    path, params=query, headers={"Authorization": f"Bearer {self._bearer()}"}
                )
            except FeedError as err:
                if err.status != 401 or self.login is None or attempt:
                    raise
                self._token = None  # an expired token (401; 403 is a plan without access): log in again
        raise AssertionError("unreachable")

    def _pairs(self, body: Any, where: str) -> list[tuple[float, float]]:
        units = _field(_field(body, "meta", where), "units", f"{where}.meta")
        name = WATTTIME_UNITS.get(str(units).lower())
        if name is None:
            raise FeedError("malformed", f"{where}: units {str(units)[:40]!r} are not an emission rate")
        return _points(_field(body, "data", where), "point_time", "value", f"{where}.data", UNITS[name])

    def read(self, since: float | None, now: float) -> Reading:
        start = now - 86400.0 if since is None else max(since, now - WATTTIME_RANGE_S)
        body = self._get("/v3/historical", start=iso_utc(start), end=iso_utc(now))
        return _with_forecast(
            Reading.of(self._pairs(body, "historical")), self._forecast, now, self.cfg.forecast
        )

    def _forecast(self, now: float) -> Issue:
        body = self._get("/v3/forecast", horizon_hours=int(math.ceil(self.cfg.horizon_h)))
        pairs = self._pairs(body, "forecast")
        generated = body["meta"].get("generated_at")
        issued = _instant(generated, "forecast.meta.generated_at") if isinstance(generated, str) else now
        return Issue(min(issued, now), *_issue_arrays(pairs))

    def history(self, start: float, end: float) -> Trace:
        pairs: list[tuple[float, float]] = []
        for a, b in _chunks(start, end, WATTTIME_RANGE_S):
            pairs += self._pairs(self._get("/v3/historical", start=iso_utc(a), end=iso_utc(b)), "historical")
        return _trace(pairs, self.region, self.name)

    def close(self) -> None:
        self.client.close()


def make_source(
    cfg: SignalConfig, trace_path: str, region: str, load: Callable[[str], Trace], variant: str = "direct"
) -> SignalSource:
    """The source ``cfg`` describes; ``trace_path``/``load``: the site's ``scheduler.trace`` and how it
    reads it (for the trace and file kinds)."""
    if cfg.kind == "trace":
        return TraceSignal(load(trace_path), region)
    if cfg.kind == "file":
        if trace_path.startswith("builtin") or Path(trace_path).is_dir():
            raise ConfigError(
                f"a file signal re-reads one file; scheduler.trace is {trace_path!r}", field="scheduler.trace"
            )
        return FileSignal(trace_path, region, load)
    if cfg.kind == "electricitymaps":
        return ElectricityMapsSignal(cfg, variant)
    return WattTimeSignal(cfg)


def history_trace(
    spec: str,
    *,
    since: float,
    until: float,
    base_url: str | None = None,
    token_env: str | None = None,
    variant: str = "direct",
) -> Trace:
    """A zone's realized signal over ``[since, until)`` from an API, named ``KIND:AREA``
    (``electricitymaps:DE``, ``watttime:CAISO_NORTH``): what ``windows`` and ``simulate`` read
    instead of a file. Errors name ``--signal`` (a spec or its config) or say what the API did."""
    kind, _, area = spec.partition(":")
    if kind not in DEFAULT_BASE_URL or not area.strip():
        raise ConfigError(f"expected electricitymaps:ZONE or watttime:REGION, got {spec!r}", where="--signal")
    fields: dict[str, Any] = {"kind": kind, "zone" if kind == "electricitymaps" else "region": area.strip()}
    fields.update({k: v for k, v in (("base_url", base_url), ("token_env", token_env)) if v is not None})
    cfg = config_from_dict(SignalConfig, fields, source="--signal")
    if not since < until:
        raise ConfigError("--since must come before --until", where="--since")
    source = ElectricityMapsSignal(cfg, variant) if kind == "electricitymaps" else WattTimeSignal(cfg)
    try:
        return source.history(since, until)
    finally:
        source.close()
