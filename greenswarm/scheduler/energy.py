"""Energy and emissions accounting for one site.

Emissions are power x intensity integrated over clock time. Integrating exactly against the trace's
step function (rather than sampling intensity at poll times) makes the totals independent of the
poll interval and of replay speed, so a replayed run reproduces the anchor's accounting exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from greenswarm.scheduler.state import SiteState
from greenswarm.traces.trace import Trace


@dataclass
class PowerModel:
    """A site's electrical draw (kW) per state. Training draws ``train_kw`` whether alone or federated;
    ``idle_kw`` is what an idle site keeps drawing (0 when GPUs are released, as greenswarm does)."""

    train_kw: float
    idle_kw: float = 0.0

    def kw(self, state: SiteState) -> float:
        return self.idle_kw if state == SiteState.IDLE else self.train_kw


class EnergyLedger:
    """Running kWh, grams of CO2 and seconds per state for one site, from ``start`` onwards."""

    def __init__(self, trace: Trace, region: str, power: PowerModel, start: float):
        trace.series(region)  # fail now, with the trace's list of regions, not at the first advance
        self.trace = trace
        self.region = region
        self.power = power
        self.t = float(start)
        self.energy_kwh = 0.0
        self.emissions_g = 0.0
        self.seconds: dict[str, float] = {state.value: 0.0 for state in SiteState}

    def advance(self, t: float, state: SiteState) -> None:
        """Book the interval from the previous call (or ``start``) to ``t`` as spent in ``state``.

        A ``t`` at or before the last one is ignored, so a clock read slightly out of order (or a
        replay restarted from a checkpoint) never books time twice or backwards.
        """
        if not t > self.t:
            return
        kw = self.power.kw(state)
        self.energy_kwh += kw * (t - self.t) / 3600.0
        self.emissions_g += kw / 3600.0 * self.trace.integral(self.region, self.t, t)
        self.seconds[SiteState(state).value] += t - self.t
        self.t = float(t)

    def state_dict(self) -> dict:
        """Plain JSON-able floats, saved with the site's checkpoint so totals survive a restart."""
        return {
            "t": self.t,
            "energy_kwh": self.energy_kwh,
            "emissions_g": self.emissions_g,
            "seconds": dict(self.seconds),
        }

    def load_state_dict(self, d: dict) -> None:
        try:
            t = float(d["t"])
            energy = float(d["energy_kwh"])
            emissions = float(d["emissions_g"])
            seconds = {state.value: float(d["seconds"].get(state.value, 0.0)) for state in SiteState}
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"malformed energy ledger state: {err!r}") from None
        if not all(math.isfinite(x) for x in (t, energy, emissions, *seconds.values())):
            raise ValueError("malformed energy ledger state: non-finite number")
        self.t, self.energy_kwh, self.emissions_g, self.seconds = t, energy, emissions, seconds


def baseline_emissions_g(trace: Trace, region: str, t0: float, t1: float, kw: float) -> float:
    """Grams of CO2 of one site training continuously at ``kw`` over ``[t0, t1]``: the comparison
    the anchor reports (a carbon-unaware run in the same region)."""
    return kw / 3600.0 * trace.integral(region, t0, t1)
