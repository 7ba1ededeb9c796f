"""The in-memory trace: grid carbon intensity per region, sampled on one shared time axis.

Every reader (wide and long CSV, WattTime, Electricity Maps and Vessim exports) produces this one
type, so window policies and energy accounting never care where the numbers came from.

A trace is a *hold-last* step function: the sample at ``times[i]`` is the intensity on
``[times[i], times[i+1])``, and the last sample covers ``[times[-1], times[-1] + resolution_s)``.
That is how grid operators publish intensity (the value for an interval, stamped at its start),
and it makes integrals exact sums, so emissions on a replayed trace match a spreadsheet to the gram.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from greenswarm.errors import TraceError

#: Spacing assumed for a one-sample trace, which has no spacing to measure.
SINGLE_SAMPLE_RESOLUTION_S = 3600.0

#: How :meth:`Trace.resampled` reads the original between its samples: ``hold`` the step function
#: itself (what a live controller sees), ``linear`` straight lines between samples (the convention
#: of the curtail-llm anchor, which interpolated intensity onto a 60 s grid).
RESAMPLE_METHODS = ("hold", "linear")


def median_resolution(times: np.ndarray) -> float:
    """Sample spacing of ``times``: the median step, so one missing sample does not change it."""
    if len(times) < 2:
        return SINGLE_SAMPLE_RESOLUTION_S
    return float(np.median(np.diff(times)))


def _positive_seconds(value: object, what: str) -> float:
    """``value`` as a finite number of seconds > 0, or a TraceError that starts with ``what``."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TraceError(f"{what} must be a number of seconds, got {value!r}") from None
    if not (math.isfinite(seconds) and seconds > 0):
        raise TraceError(f"{what} must be a finite number of seconds > 0, got {value!r}")
    return seconds


@dataclass(frozen=True, eq=False)
class Trace:
    """Carbon intensity (gCO2/kWh) of one or more grid regions over time.

    ``times`` are float64 unix seconds (UTC), strictly increasing; ``values`` maps each region (in
    column order) to an array of the same length, finite and >= 0. The arrays are made read-only so
    that a trace shared by a policy and a ledger cannot change under either. Equality is identity
    (``eq=False``): comparing numpy arrays element-wise has no single truth value.
    """

    times: np.ndarray
    values: dict[str, np.ndarray]
    resolution_s: float
    source: str

    def __post_init__(self) -> None:
        times = np.array(self.times, dtype=np.float64)
        if times.ndim != 1 or len(times) < 1:
            raise TraceError(f"{self.source}: a trace needs at least one sample")
        if not np.all(np.isfinite(times)):
            raise TraceError(f"{self.source}: timestamps must be finite")
        if len(times) > 1 and not np.all(np.diff(times) > 0):
            raise TraceError(f"{self.source}: timestamps must be strictly increasing")
        if not self.values:
            raise TraceError(f"{self.source}: a trace needs at least one region")
        if not (np.isfinite(self.resolution_s) and self.resolution_s > 0):
            raise TraceError(f"{self.source}: resolution must be a positive number of seconds")
        values: dict[str, np.ndarray] = {}
        for region, series in self.values.items():
            arr = np.array(series, dtype=np.float64)
            if arr.shape != times.shape:
                raise TraceError(
                    f"{self.source}: region '{region}' has {arr.size} values for {len(times)} timestamps"
                )
            if not np.all(np.isfinite(arr)) or np.any(arr < 0):
                raise TraceError(f"{self.source}: region '{region}' has negative or non-finite values")
            arr.setflags(write=False)
            values[region] = arr
        times.setflags(write=False)
        object.__setattr__(self, "times", times)
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "resolution_s", float(self.resolution_s))
        # Per-region running integrals, filled lazily; not a field, so replace()/fields() ignore it.
        object.__setattr__(self, "_cumulative", {})

    @classmethod
    def from_columns(cls, times: np.ndarray, values: dict[str, np.ndarray], source: str) -> Trace:
        """Build a trace whose resolution is measured from ``times`` (what every reader wants)."""
        times = np.asarray(times, dtype=np.float64)
        return cls(times=times, values=values, resolution_s=median_resolution(times), source=source)

    @property
    def regions(self) -> list[str]:
        """Region names in column order."""
        return list(self.values)

    @property
    def start(self) -> float:
        """First instant the trace covers."""
        return float(self.times[0])

    @property
    def end(self) -> float:
        """First instant after the trace: the last sample still covers one resolution step."""
        return float(self.times[-1]) + self.resolution_s

    def series(self, region: str) -> np.ndarray:
        """The (read-only) intensity samples of ``region``; a helpful error if there is no such region."""
        try:
            return self.values[region]
        except KeyError:
            raise TraceError(
                f"region '{region}' is not in {self.source}; it has: {', '.join(self.values)}"
            ) from None

    def _index(self, t: float) -> int:
        """Index of the sample in force at ``t``, clamped: the first before the trace, the last after."""
        i = int(np.searchsorted(self.times, t, side="right")) - 1
        return min(max(i, 0), len(self.times) - 1)

    def intensity(self, region: str, t: float) -> float:
        """Intensity at instant ``t``: the sample at or before ``t``.

        Before the trace the first value holds and after it the last one does, so a clock that
        runs a little past either edge gets a sensible number rather than an exception.
        """
        return float(self.series(region)[self._index(t)])

    def _cumulative_at_samples(self, region: str) -> np.ndarray:
        """``C[i]`` = integral of the step function from ``times[0]`` to ``times[i]``; cached per region."""
        cum = self._cumulative.get(region)
        if cum is None:
            series = self.series(region)
            cum = np.zeros(len(self.times), dtype=np.float64)
            if len(self.times) > 1:
                cum[1:] = np.cumsum(series[:-1] * np.diff(self.times))
            cum.setflags(write=False)
            self._cumulative[region] = cum
        return cum

    def _antiderivative(self, region: str, t: float) -> float:
        """Integral of the clamped step function from ``times[0]`` to ``t`` (negative for t < start)."""
        i = self._index(t)
        return float(self._cumulative_at_samples(region)[i] + self.series(region)[i] * (t - self.times[i]))

    def integral(self, region: str, t0: float, t1: float) -> float:
        """Exact integral of :meth:`intensity` over ``[t0, t1]`` in (gCO2/kWh) x seconds.

        Multiplying by kW / 3600 gives grams. Clamps like :meth:`intensity`; for ``t1 < t0`` the
        result is negative (the signed integral), which keeps ``integral(a, b) + integral(b, c)``
        equal to ``integral(a, c)`` for any order.
        """
        self.series(region)
        if t0 == t1:
            return 0.0
        return self._antiderivative(region, t1) - self._antiderivative(region, t0)

    def resampled(self, step_s: float, method: str = "linear") -> Trace:
        """This trace on the regular grid ``start, start + step_s, ... < end``, same regions.

        Each grid value is the original read at the grid instant: linearly interpolated between
        samples (``linear``, the last sample holding to the end) or the step function's value
        (``hold``). The result is again hold-last between grid points, so integrals stay exact sums
        and the rest of greenswarm needs no second code path. Its end is rounded up to a whole
        step, so it may run up to one ``step_s`` past this trace's end (the last value holds there).
        """
        if method not in RESAMPLE_METHODS:
            raise TraceError(
                f"{self.source}: unknown resampling method '{method}'; choices: {', '.join(RESAMPLE_METHODS)}"
            )
        step = _positive_seconds(step_s, f"{self.source}: resampling step")
        grid = self._grid(step)
        if method == "linear":
            values = {region: np.interp(grid, self.times, series) for region, series in self.values.items()}
        else:
            at = np.clip(np.searchsorted(self.times, grid, side="right") - 1, 0, len(self.times) - 1)
            values = {region: series[at] for region, series in self.values.items()}
        return Trace(grid, values, step, f"{self.source} ({method}, {step:g} s grid)")

    def _grid(self, step_s: float) -> np.ndarray:
        """Grid instants ``start + k * step_s`` before ``end``; rounding the count to 1e-9 steps keeps
        a span that is a whole number of steps (18 h / 60 s) from gaining a spurious extra point."""
        n = max(1, math.ceil(round((self.end - self.start) / step_s, 9)))
        return self.start + step_s * np.arange(n, dtype=np.float64)

    def __repr__(self) -> str:
        return (
            f"Trace(source={self.source!r}, regions={self.regions}, samples={len(self.times)}, "
            f"start={self.start}, resolution_s={self.resolution_s})"
        )
