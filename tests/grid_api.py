"""Electricity Maps v3 and WattTime v3, served from a trace over real HTTP on 127.0.0.1.

:class:`ReplayedApi` answers the endpoints greenswarm reads with each API's JSON shapes, built from a
trace and revealed by a clock (``now``): ``latest`` is the sample in force now, ``history`` the last
24 h, a forecast the trace's own next 24 h (issued now). Faults are switched on by name
(:data:`FAULTS`) through :meth:`ReplayedApi.fail`: the explicit hook the outage tests use, and the
real node test drives by clock time.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pytest_httpserver import HTTPServer
from werkzeug import Request, Response

from greenswarm.timefmt import iso_utc, parse_iso
from greenswarm.traces.trace import Trace

EM_TOKEN = "em-test-token-3f9c1a7d5e"
WT_USER, WT_PASSWORD = "site-operator", "wt-test-password-8b2e"
WT_TOKEN = "wt-bearer-token-6d41c0"
LBS_PER_MWH = 1 / 0.453592  # g/kWh -> lbs/MWh
#: every fault the API can serve; "slow" answers after ``slow_s``
FAULTS = (
    "http 500",
    "http 503",
    "rate-limited",
    "refused",
    "html",
    "truncated",
    "missing field",
    "nan",
    "negative",
    "backwards",
    "future",
    "slow",
    "empty",
    "unknown area",
)


@contextmanager
def api_server() -> Iterator[HTTPServer]:
    """A threaded HTTP server on 127.0.0.1 and an ephemeral port (a slow answer holds no one else up)."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request drowns what matters
    server = HTTPServer(host="127.0.0.1", port=0, threaded=True)
    server.start()
    try:
        yield server
    finally:
        server.clear()
        if server.is_running():
            server.stop()


class ReplayedApi:
    """Both APIs for one zone/region of ``trace``, at ``server.url_for('')``."""

    def __init__(self, server: HTTPServer, trace: Trace, zone: str, now: Callable[[], float]):
        self.server, self.trace, self.zone, self.now = server, trace, zone, now
        self.fault: str | None = None
        #: what the forecast endpoints alone do: "refused" (a plan without forecasts), "nan", "negative"
        self.forecast_fault: str | None = None
        #: faults by clock time: (start, end, fault) -- the real node test's outages
        self.timetable: list[tuple[float, float, str]] = []
        self.slow_s = 3.0
        self.retry_after_s = 1
        self.requests: list[tuple[str, dict[str, str], float]] = []  # (path, query, monotonic time)
        self._lock = threading.Lock()
        for path in ("latest", "history", "forecast", "past-range"):
            server.expect_request(f"/v3/carbon-intensity/{path}").respond_with_handler(self._em(path))
        server.expect_request("/login").respond_with_handler(self._wt_login)
        for path in ("historical", "forecast"):
            server.expect_request(f"/v3/{path}").respond_with_handler(self._wt(path))

    @property
    def url(self) -> str:
        return self.server.url_for("").rstrip("/")

    def fail(self, fault: str | None) -> None:
        assert fault is None or fault in FAULTS, fault
        self.fault = fault

    # ------------------------------------------------------------------ the trace, as the API knows it

    def _samples(self, start: float, end: float) -> list[tuple[float, float]]:
        """Samples stamped in [start, end] and not after now."""
        now = self.now()
        values = self.trace.series(self.trace.regions[0])
        return [
            (float(t), float(v))
            for t, v in zip(self.trace.times, values, strict=True)
            if start <= t <= min(end, now)
        ]

    def _future(self, hours: float = 24.0) -> list[tuple[float, float]]:
        now = self.now()
        values = self.trace.series(self.trace.regions[0])
        return [
            (float(t), float(v))
            for t, v in zip(self.trace.times, values, strict=True)
            if now < t <= now + hours * 3600
        ]

    def current_fault(self) -> str | None:
        now = self.now()
        return next((f for a, b, f in self.timetable if a <= now < b), self.fault)

    def _corrupt(self, pairs: list[tuple[float, float]]) -> list[tuple[float, Any]]:
        fault = self.current_fault()
        if fault == "nan":
            return [(t, None) for t, _ in pairs]
        if fault == "negative":
            return [(t, -abs(v) - 1) for t, v in pairs]
        if fault == "backwards":
            return [(t - 3 * 86400, v) for t, v in pairs]
        if fault == "future":
            return [(t + 3 * 86400, v) for t, v in pairs]
        if fault == "empty":
            return []
        return list(pairs)

    # ------------------------------------------------------------------ faults that replace the answer

    def _fault_response(self) -> Response | None:
        fault = self.current_fault()
        if fault == "slow":
            time.sleep(self.slow_s)
            return None
        if fault == "http 500":
            return Response('{"error": "internal"}', status=500, content_type="application/json")
        if fault == "http 503":
            return Response("Service Unavailable", status=503)
        if fault == "rate-limited":
            headers = {"Retry-After": str(self.retry_after_s)}
            return Response('{"message": "Too Many Requests"}', status=429, headers=headers)
        if fault == "refused":
            return Response('{"error": "invalid token"}', status=401, content_type="application/json")
        if fault == "unknown area":
            body = '{"status": "error", "message": "Zone does not exist."}'
            return Response(body, status=404, content_type="application/json")
        if fault == "html":
            return Response("<html><body>Bad Gateway</body></html>", status=200, content_type="text/html")
        return None

    def _json(self, body: Any) -> Response:
        text = json.dumps(body)
        if self.current_fault() == "truncated":
            text = text[: len(text) // 2]
        return Response(text, status=200, content_type="application/json")

    def _log(self, request: Request) -> None:
        with self._lock:
            self.requests.append((request.path, dict(request.args), time.monotonic()))

    # ------------------------------------------------------------------ Electricity Maps v3

    def _em(self, what: str) -> Callable[[Request], Response]:
        def handle(request: Request) -> Response:
            self._log(request)
            if request.headers.get("auth-token") != EM_TOKEN:
                return Response(
                    '{"message": "Invalid auth-token"}', status=401, content_type="application/json"
                )
            if request.args.get("zone") != self.zone:
                message = {"status": "error", "message": f"Zone '{request.args.get('zone')}' does not exist."}
                return Response(json.dumps(message), status=404, content_type="application/json")
            failed = self._fault_response()
            if failed is not None:
                return failed
            if what == "forecast" and self.forecast_fault == "refused":
                return Response('{"message": "not in your plan"}', 403, content_type="application/json")
            return self._json(self._em_body(what, request))

        return handle

    def _em_row(self, t: float, v: Any) -> dict[str, Any]:
        return {
            "zone": self.zone,
            "carbonIntensity": None
            if v is None
            else (round(v) if isinstance(v, float) and v.is_integer() else v),
            "datetime": iso_utc(t, milliseconds=True),
            "updatedAt": iso_utc(self.now(), milliseconds=True),
            "createdAt": iso_utc(t, milliseconds=True),
            "emissionFactorType": "direct",
            "isEstimated": False,
            "estimationMethod": None,
        }

    def _em_body(self, what: str, request: Request) -> Any:
        now = self.now()
        if what == "latest":
            pairs = self._corrupt(self._samples(-math.inf, now)[-1:])
            if not pairs:
                return {"zone": self.zone}  # nothing to say: a body without the fields
            row = self._em_row(*pairs[-1])
            if self.current_fault() == "missing field":
                del row["carbonIntensity"]
            return row
        if what == "history":
            rows = [self._em_row(t, v) for t, v in self._corrupt(self._samples(now - 86400 + 1, now))]
            if self.current_fault() == "missing field":
                return {"zone": self.zone, "data": rows}
            return {"zone": self.zone, "history": rows}
        if what == "past-range":
            start, end = parse_iso(request.args["start"]), parse_iso(request.args["end"])
            return {"zone": self.zone, "data": [self._em_row(t, v) for t, v in self._samples(start, end - 1)]}
        future = self._future()
        if self.forecast_fault == "nan":
            future = [(t, None if i % 2 else v) for i, (t, v) in enumerate(future)]
        elif self.forecast_fault == "negative":
            future = [(t, -1.0) for t, _ in future]
        rows = [{"carbonIntensity": v, "datetime": iso_utc(t, milliseconds=True)} for t, v in future]
        return {"zone": self.zone, "forecast": rows, "updatedAt": iso_utc(now, milliseconds=True)}

    # ------------------------------------------------------------------ WattTime v3

    def _wt_login(self, request: Request) -> Response:
        self._log(request)
        auth = request.authorization
        if auth is None or (auth.username, auth.password) != (WT_USER, WT_PASSWORD):
            return Response('{"error": "invalid credentials"}', status=403, content_type="application/json")
        return Response(json.dumps({"token": WT_TOKEN}), status=200, content_type="application/json")

    def _wt(self, what: str) -> Callable[[Request], Response]:
        def handle(request: Request) -> Response:
            self._log(request)
            if request.headers.get("Authorization") != f"Bearer {WT_TOKEN}":
                return Response('{"error": "unauthorized"}', status=401, content_type="application/json")
            if request.args.get("region") != self.zone:
                return Response('{"error": "region not found"}', status=400, content_type="application/json")
            failed = self._fault_response()
            if failed is not None:
                return failed
            now = self.now()
            meta = {
                "region": self.zone,
                "signal_type": request.args.get("signal_type"),
                "units": "lbs_co2_per_mwh",
                "data_point_period_seconds": int(self.trace.resolution_s),
                "warnings": [],
            }
            if what == "historical":
                start, end = parse_iso(request.args["start"]), parse_iso(request.args["end"])
                pairs = self._corrupt(self._samples(start, end))
            else:
                pairs, meta["generated_at"] = self._future(), iso_utc(now)
            data = [
                {"point_time": iso_utc(t), "value": None if v is None else v * LBS_PER_MWH} for t, v in pairs
            ]
            if self.current_fault() == "missing field":
                data = [{"point_time": d["point_time"]} for d in data]
            return self._json({"data": data, "meta": meta})

        return handle
