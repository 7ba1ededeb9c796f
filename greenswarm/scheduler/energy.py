"""Energy and emissions accounting for one site.

Emissions are power x intensity integrated over clock time. Integrating exactly against the trace's
step function (rather than sampling intensity at poll times) makes the totals independent of the
poll interval and of replay speed, so a replayed run reproduces the anchor's accounting exactly.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from greenswarm.errors import ConfigError, GreenswarmError
from greenswarm.scheduler.state import SiteState
from greenswarm.traces.trace import Trace

if TYPE_CHECKING:
    from greenswarm.scheduler.config import EnergyConfig

log = logging.getLogger("greenswarm.energy")

#: A power meter: called with no arguments, returns the present draw in kW.
Meter = Callable[[], float]


@dataclass
class PowerModel:
    """A site's electrical draw (kW) per state. Training draws ``train_kw`` whether alone or federated;
    ``idle_kw`` is what an idle site keeps drawing (the node keeps its model on the GPUs while IDLE).

    With a ``meter`` (such as :class:`NvmlPower`) every state draws what the meter reads at that
    moment instead, so a site books what its hardware really used -- while IDLE, what its GPUs draw
    holding the model.
    """

    train_kw: float
    idle_kw: float = 0.0
    meter: Meter | None = None
    released_kw: float = 0.0

    def kw(self, state: SiteState) -> float:
        if state == SiteState.RELEASED:  # (no process of the site's reads a meter then)
            return self.released_kw
        if self.meter is not None:
            return float(self.meter())
        return self.idle_kw if state == SiteState.IDLE else self.train_kw


class NvmlUnavailable(GreenswarmError):
    """NVML cannot measure this process's GPUs: no pynvml, no driver, or no GPU visible."""


def visible_gpu_indices(cuda_visible_devices: str | None, count: int) -> list[int]:
    """Indices of the GPUs this process may use, out of ``count``, as CUDA reads the variable.

    Unset means all of them. Otherwise the comma-separated indices in order, stopping at the first
    one out of range (CUDA's own rule, which is why ``-1`` or an empty value hides every GPU).
    Indices are NVML's (PCI bus order), which matches CUDA's with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
    GPU or MIG UUIDs are refused rather than guessed at.
    """
    if cuda_visible_devices is None:
        return list(range(count))
    indices: list[int] = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        try:
            index = int(entry)
        except ValueError:
            if not entry:
                break
            raise NvmlUnavailable(
                f"CUDA_VISIBLE_DEVICES entry {entry!r} is not a GPU index; NVML power reads GPUs by index"
            ) from None
        if not 0 <= index < count:
            break
        if index not in indices:
            indices.append(index)
    return indices


def _import_pynvml() -> Any:
    """The optional pynvml module (PyPI: nvidia-ml-py), imported only when power is measured, so a
    CPU-only install never needs it."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        raise NvmlUnavailable(
            "measuring GPU power needs the pynvml module: pip install nvidia-ml-py"
        ) from None
    return pynvml


class NvmlPower:
    """The present draw (kW) of the GPUs visible to this process, read through NVML, times
    ``overhead`` (>= 1) for the rest of the machine (CPUs, fans, PSU losses) that NVML cannot see.

    Construction reads the power once, so a missing driver or GPU fails at start-up, not in the
    middle of a run. Later a failed read (a GPU briefly unresponsive) logs a warning and returns
    the last good reading: a glitch in accounting must not stop training.
    """

    def __init__(self, overhead: float = 1.0, cuda_visible_devices: str | None = None):
        self.pynvml = _import_pynvml()
        self.overhead = float(overhead)
        try:
            self.pynvml.nvmlInit()
            count = int(self.pynvml.nvmlDeviceGetCount())
        except self.pynvml.NVMLError as err:
            raise NvmlUnavailable(f"NVML cannot start ({err}); is an NVIDIA driver installed?") from None
        visible = (
            os.environ.get("CUDA_VISIBLE_DEVICES") if cuda_visible_devices is None else cuda_visible_devices
        )
        self.indices = visible_gpu_indices(visible, count)
        if not self.indices:
            raise NvmlUnavailable(
                f"NVML sees no GPU for this process ({count} on the machine; "
                f"CUDA_VISIBLE_DEVICES={visible!r})"
            )
        try:
            self.handles = [self.pynvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices]
            self.last_kw = self._read()
        except self.pynvml.NVMLError as err:
            raise NvmlUnavailable(f"NVML cannot read GPU power ({err})") from None
        self._warned = False

    def _read(self) -> float:
        milliwatts = sum(int(self.pynvml.nvmlDeviceGetPowerUsage(h)) for h in self.handles)
        return self.overhead * milliwatts / 1e6

    def __call__(self) -> float:
        try:
            self.last_kw = self._read()
        except self.pynvml.NVMLError as err:
            if not self._warned:
                log.warning(
                    "NVML power read failed (%s); booking the last reading, %.3f kW", err, self.last_kw
                )
                self._warned = True
        return self.last_kw


def make_power_model(cfg: EnergyConfig, *, on_gpu: bool = True) -> PowerModel:
    """The power model ``cfg`` asks for (see :class:`~greenswarm.scheduler.config.EnergyConfig`).

    ``source: nvml`` without a working NVML is a one-line error naming ``energy.source``. ``auto``
    falls back to ``train_kw`` quietly, and also when ``on_gpu`` is False: a site training on the CPU
    of a GPU machine would otherwise book the draw of GPUs it does not use.
    """
    try:
        cfg.validate()
    except ConfigError as err:
        raise err.located("energy") from None
    meter: Meter | None = None
    if cfg.source == "nvml" or (cfg.source == "auto" and on_gpu):
        try:
            meter = NvmlPower(cfg.nvml_overhead)
        except NvmlUnavailable as err:
            if cfg.source == "nvml":
                raise ConfigError(
                    f"{err} (or set energy.source to config to book train_kw)", field="energy.source"
                ) from None
            log.info("energy: not measuring GPU power (%s); booking train_kw %g kW", err, cfg.train_kw)
    if isinstance(meter, NvmlPower):
        log.info(
            "energy: measuring GPUs %s through NVML (x%g overhead), now %.3f kW",
            meter.indices,
            meter.overhead,
            meter.last_kw,
        )
    return PowerModel(cfg.train_kw, cfg.idle_kw, meter, cfg.released_kw)


class EnergyLedger:
    """Running kWh, grams of CO2 and seconds per state for one site, from ``start`` onwards.

    ``trace`` is the site's trace, or for a live signal a callable that returns the signal as
    observed so far (None before its first sample: energy is booked, emissions cannot be).
    """

    def __init__(
        self, trace: Trace | Callable[[], Trace | None], region: str, power: PowerModel, start: float
    ):
        if isinstance(trace, Trace):
            trace.series(region)  # fail now, with the trace's list of regions, not at the first advance
        self._trace = trace
        self.region = region
        self.power = power
        self.t = float(start)
        self.energy_kwh = 0.0
        self.emissions_g = 0.0
        self.seconds: dict[str, float] = {state.value: 0.0 for state in SiteState}
        self.kwh: dict[str, float] = {state.value: 0.0 for state in SiteState}  # energy by state
        self.grams: dict[str, float] = {state.value: 0.0 for state in SiteState}  # emissions by state
        self.unbooked_s = 0.0  # clock seconds skipped at restarts (see skip_to)

    def advance(self, t: float, state: SiteState) -> None:
        """Book the interval from the previous call (or ``start``) to ``t`` as spent in ``state``.

        A ``t`` at or before the last one is ignored, so a clock read slightly out of order (or a
        replay restarted from a checkpoint) never books time twice or backwards.
        """
        if not t > self.t:
            return
        kw = self.power.kw(state)
        self.energy_kwh += kw * (t - self.t) / 3600.0
        trace = self.trace
        grams = kw / 3600.0 * trace.integral(self.region, self.t, t) if trace is not None else 0.0
        self.emissions_g += grams
        self.seconds[SiteState(state).value] += t - self.t
        self.kwh[SiteState(state).value] += kw * (t - self.t) / 3600.0
        self.grams[SiteState(state).value] += grams
        self.t = float(t)

    def skip_to(self, t: float) -> float:
        """Move to ``t`` without booking the time in between (a restart: what the site drew between
        its checkpoint and now, and in which state, is unknown); the seconds skipped."""
        gap = max(0.0, float(t) - self.t)
        self.t = max(self.t, float(t))
        self.unbooked_s += gap
        return gap

    @property
    def trace(self) -> Trace | None:
        """The intensity this ledger books against now."""
        return self._trace if isinstance(self._trace, Trace) else self._trace()

    def state_dict(self) -> dict:
        """Plain JSON-able floats, saved with the site's checkpoint so totals survive a restart."""
        return {
            "t": self.t,
            "energy_kwh": self.energy_kwh,
            "emissions_g": self.emissions_g,
            "seconds": dict(self.seconds),
            "kwh": dict(self.kwh),
            "grams": dict(self.grams),
            "unbooked_s": self.unbooked_s,
        }

    def load_state_dict(self, d: dict) -> None:
        try:
            t = float(d["t"])
            energy = float(d["energy_kwh"])
            emissions = float(d["emissions_g"])
            seconds = {state.value: float(d["seconds"].get(state.value, 0.0)) for state in SiteState}
            kwh = {state.value: float(d.get("kwh", {}).get(state.value, 0.0)) for state in SiteState}
            grams = {state.value: float(d.get("grams", {}).get(state.value, 0.0)) for state in SiteState}
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"malformed energy ledger state: {err!r}") from None
        if not all(
            math.isfinite(x)
            for x in (t, energy, emissions, *seconds.values(), *kwh.values(), *grams.values())
        ):
            raise ValueError("malformed energy ledger state: non-finite number")
        self.t, self.energy_kwh, self.emissions_g, self.seconds = t, energy, emissions, seconds
        self.kwh, self.grams = kwh, grams
        self.unbooked_s = float(d.get("unbooked_s", 0.0))


def baseline_emissions_g(trace: Trace, region: str, t0: float, t1: float, kw: float) -> float:
    """Grams of CO2 of one site training continuously at ``kw`` over ``[t0, t1]``: the comparison
    the anchor reports (a carbon-unaware run in the same region)."""
    return kw / 3600.0 * trace.integral(region, t0, t1)
