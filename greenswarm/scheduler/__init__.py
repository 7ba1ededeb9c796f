"""Scheduling a site: window policies, clocks, the IDLE/SOLO/FEDERATED state, energy accounting."""

from greenswarm.scheduler.clock import Clock, ReplayClock, ScaledClock, WallClock, make_clock
from greenswarm.scheduler.config import ClockConfig, EnergyConfig, SchedulerConfig
from greenswarm.scheduler.energy import EnergyLedger, PowerModel, baseline_emissions_g
from greenswarm.scheduler.policy import (
    PercentilePolicy,
    ThresholdPolicy,
    Window,
    WindowPolicy,
    WindowSchedule,
)
from greenswarm.scheduler.state import SiteState, decide_state
from greenswarm.timefmt import parse_instant

__all__ = [
    "Clock",
    "ClockConfig",
    "EnergyConfig",
    "EnergyLedger",
    "PercentilePolicy",
    "PowerModel",
    "ReplayClock",
    "ScaledClock",
    "SchedulerConfig",
    "SiteState",
    "ThresholdPolicy",
    "WallClock",
    "Window",
    "WindowPolicy",
    "WindowSchedule",
    "baseline_emissions_g",
    "decide_state",
    "make_clock",
    "parse_instant",
]
