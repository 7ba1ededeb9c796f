"""An offline, built-in trace model, so that the demo and the tests run without any data files.

This is a *synthetic* model, not a measurement. Each region gets 24 typical hourly marginal
intensities in its local time, linearly interpolated to the step and multiplied by seeded AR(1)
noise of a few percent. The figures were chosen by hand so that:

* the levels span the ranges of the curtail-llm anchor trace (WattTime marginal operating emissions
  rate, 18 h from 2026-01-11 17:00 UTC; see "The anchor experiment" in DESIGN.md): CAISO_NORTH
  about 40-465, SPP_TX about 5-660, NEM_SA about 0-940 gCO2/kWh;
* the timing follows each grid's well-known daily pattern: California curtails solar around noon
  (gas on the margin otherwise), the Texas part of SPP curtails wind at night, South Australia
  curtails rooftop and utility solar through the middle of the day.

With the default start (the anchor's) and a 100 gCO2/kWh threshold the windows are staggered like
the anchor's: CAISO_NORTH for about the first 5.2 h, NEM_SA from about 5.5 h to 13.5 h, SPP_TX from
about 10.9 h to the end, so a run sees periods with 0, 1 and 2 sites in a window. UTC offsets are
fixed (January: no daylight saving in California or Texas, daylight time in South Australia).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from greenswarm.errors import ConfigError, TraceError
from greenswarm.timefmt import parse_instant
from greenswarm.traces.trace import Trace

#: Standard deviation of the multiplicative noise (fraction of the level).
NOISE_FRACTION = 0.02
#: Correlation time of the noise: intensity wanders over tens of minutes, not sample to sample.
NOISE_CORRELATION_S = 1800.0


@dataclass(frozen=True)
class RegionModel:
    """Typical marginal intensity (gCO2/kWh) at each local hour 0..23, and the region's UTC offset."""

    utc_offset_h: float
    hourly: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.hourly) != 24:
            raise ValueError(f"a region model needs 24 hourly values, got {len(self.hourly)}")

    def level(self, times: np.ndarray) -> np.ndarray:
        """Noise-free intensity at unix ``times``: the hourly table interpolated in local time."""
        local_h = np.mod(times / 3600.0 + self.utc_offset_h, 24.0)
        knots = np.arange(25, dtype=np.float64)
        return np.interp(local_h, knots, np.array((*self.hourly, self.hourly[0]), dtype=np.float64))


# fmt: off
_ANCHOR3: dict[str, RegionModel] = {
    # Solar curtailment ~09:00-14:00 local; gas-fired units on the margin otherwise.
    "CAISO_NORTH": RegionModel(-8.0, (
        445, 442, 440, 438, 439, 442, 448, 450, 440, 70, 55, 45,
        42, 48, 75, 210, 440, 452, 450, 448, 447, 446, 445, 445,
    )),
    # Night-time wind curtailment ~22:00-08:00 local; coal and gas by day.
    "SPP_TX": RegionModel(-6.0, (
        20, 12, 8, 6, 8, 12, 25, 45, 90, 610, 630, 645,
        640, 645, 640, 635, 628, 622, 618, 614, 610, 605, 55, 30,
    )),
    # Midday solar ~09:00-17:00 local (ACDT, UTC+10:30); gas and imports otherwise.
    "NEM_SA": RegionModel(10.5, (
        880, 875, 870, 865, 860, 855, 850, 845, 860, 90, 20, 8,
        2, 0, 0, 5, 15, 60, 870, 905, 900, 895, 890, 885,
    )),
}
# fmt: on

_MODELS: dict[str, dict[str, RegionModel]] = {"anchor3": _ANCHOR3}
DEFAULT_BUILTIN = "anchor3"


def _parse_start(text: str) -> float:
    try:
        return parse_instant(text)
    except ConfigError as e:
        raise TraceError(f"builtin trace: start: {e.message}") from None


def builtin_trace(
    name: str = DEFAULT_BUILTIN,
    start: str = "2026-01-11T17:00:00Z",
    hours: float = 18.0,
    step_s: float = 300.0,
    seed: int = 0,
) -> Trace:
    """Generate the built-in trace ``name``: ``hours`` of samples every ``step_s`` from ``start``.

    The same arguments always give the same trace (the noise comes from ``seed`` alone), so a demo
    or test can be rerun and compared. Regions get independent noise streams.
    """
    model = _MODELS.get(name)
    if model is None:
        raise TraceError(f"no builtin trace '{name}'; available: {', '.join(_MODELS)}")
    if not (math.isfinite(step_s) and step_s > 0):
        raise TraceError(f"builtin trace: step_s must be > 0, got {step_s}")
    if not (math.isfinite(hours) and hours > 0):
        raise TraceError(f"builtin trace: hours must be > 0, got {hours}")
    t0 = _parse_start(start)
    n = max(1, round(hours * 3600.0 / step_s))
    times = t0 + step_s * np.arange(n, dtype=np.float64)
    phi = math.exp(-step_s / NOISE_CORRELATION_S)
    innovation = NOISE_FRACTION * math.sqrt(1.0 - phi * phi)
    rng = np.random.default_rng(seed)
    values: dict[str, np.ndarray] = {}
    for region, region_model in model.items():
        shocks = rng.standard_normal(n)
        noise = np.empty(n, dtype=np.float64)
        noise[0] = NOISE_FRACTION * shocks[0]
        for i in range(1, n):
            noise[i] = phi * noise[i - 1] + innovation * shocks[i]
        values[region] = np.clip(region_model.level(times) * (1.0 + noise), 0.0, None)
    return Trace(times, values, float(step_s), f"builtin:{name}")


#: Built-in traces by name; each entry is called with no arguments by ``load_trace("builtin:<name>")``.
BUILTIN_TRACES: dict[str, Callable[..., Trace]] = {
    model_name: partial(builtin_trace, model_name) for model_name in _MODELS
}
