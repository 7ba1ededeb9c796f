"""What a site says about itself: its progress record, its log line and its summary.

The site's own counters live in :class:`~greenswarm.node.site_stats.SiteStats`. The functions here
read a running :class:`~greenswarm.node.site.SiteNode` and describe it: the signed progress record
that other sites and ``greenswarm progress`` read, the periodic log line, and the summary written at
the end of a run.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Protocol

from greenswarm.node.global_eval import perplexity
from greenswarm.node.progress import ProgressRecord
from greenswarm.scheduler.state import SiteState
from greenswarm.timefmt import utc_minute


class RunningSite(Protocol):
    """What these functions read of a :class:`~greenswarm.node.site.SiteNode` (typed here, so that
    describing the node does not import it)."""

    cfg: Any
    world: Any
    clock: Any
    schedule: Any
    ledger: Any
    state: SiteState
    peer_id: str
    stats: Any  # SiteStats
    global_state: Any  # GlobalState
    federation: Any  # Federation, once the site has joined
    swarm: Any  # SwarmParts, once the site has joined
    trainer: Any  # InnerTrainer (its model's identity)
    shards: Any  # ShardClaims with data.sharding: claim, else None
    connections: dict[str, list[str]]
    log: Any  # logging.Logger


def progress_record(node: RunningSite) -> ProgressRecord:
    """The site's progress record, as the swarm reads it."""
    now, stats, state = node.clock.now(), node.stats, node.global_state
    window = node.schedule.current(now) if node.state is not SiteState.IDLE else None
    # one step's position and digest, even while a round's thread moves the state
    (outer_round, lineage, round_index), attested = state.attestation()
    return ProgressRecord(
        site=node.cfg.name,
        region=node.cfg.region,
        state=node.state.value,
        peer_id=node.peer_id,
        outer_round=outer_round,
        lineage=lineage,
        round_index=round_index,
        local_steps=stats.local_steps,
        tokens=stats.tokens,
        loss=None if stats.loss is None or not math.isfinite(stats.loss) else float(stats.loss),
        window_end=float(window.end) if window else None,
        energy_kwh=node.ledger.energy_kwh,
        emissions_g=node.ledger.emissions_g,
        clock_time=now,
        wall_time=time.time(),
        world_size=node.world.world_size,
        wire=node.federation.wire if node.federation is not None and node.federation.wire else None,
        refused=stats.counts["refused_updates"],
        next_start=getattr(node.schedule, "next_start", None) or node.releaser.planned_restart(now),
        plan=getattr(node.schedule, "share", None),
        model=node.trainer.identity.to_wire(),
        state_digest=attested,
        eval_loss=_finite(stats.eval_loss),
        eval_round=stats.eval_round,
        eval_digest=stats.eval_digest,
    )


def _finite(value: float | None) -> float | None:
    """``value``, or None where it is not a finite number (records and JSON take no NaN)."""
    return value if value is not None and math.isfinite(value) else None


def status_line(node: RunningSite) -> str:
    """The periodic log line: state, clock, global step, training progress and energy."""
    stats = node.stats
    loss = "-" if stats.loss is None else f"{stats.loss:.3f}"
    return (
        f"{node.state.value} at {utc_minute(node.clock.now())}: outer step {node.global_state.outer_round}, "
        f"{stats.local_steps} steps, {stats.tokens:,} tokens, loss {loss}, "
        f"{node.ledger.energy_kwh:.3f} kWh, {node.ledger.emissions_g:.1f} gCO2"
    )


def summary(node: RunningSite) -> dict[str, Any]:
    """The site's summary (``run_dir/summary.json`` and the node's last line of output)."""
    stats, state, federation, swarm = node.stats, node.global_state, node.federation, node.swarm
    rounds = sorted(federation.round_seconds) if federation else []
    agreement = federation.agreement_seconds if federation else []
    return {
        "site": node.cfg.name,
        "region": node.cfg.region,
        "peer_id": node.peer_id,
        "outer_round": state.outer_round,
        "lineage": state.lineage,
        "digest": state.digest(),
        **stats.counts,
        "local_steps": stats.local_steps,
        "tokens": stats.tokens,
        "tokens_since_sync": stats.tokens_since_sync,  # trained since its last outer step: in no global model
        "loss": stats.loss,
        "first_loss": stats.first_loss,
        # the global model's held-out loss, last measured here (at the end of the run, of its last state)
        "eval_loss": _finite(stats.eval_loss),
        "eval_perplexity": perplexity(_finite(stats.eval_loss)),
        "eval_round": stats.eval_round,
        "eval_digest": stats.eval_digest,
        "eval_tokens": stats.eval_tokens,
        "eval_set": stats.eval_set,
        "energy_kwh": node.ledger.energy_kwh,
        "emissions_g": node.ledger.emissions_g,
        "seconds_by_state": dict(node.ledger.seconds),
        "kwh_by_state": dict(node.ledger.kwh),
        "emissions_g_by_state": dict(node.ledger.grams),
        "unbooked_s": node.ledger.unbooked_s,  # skipped at restarts: the site's draw then is unknown
        # what `greenswarm simulate --calibrate` needs to turn this run's wall seconds into clock seconds
        "clock_speedup": float(getattr(node.clock, "speedup", 1.0)),
        "release": node.releaser.applied(),  # the rule in clock seconds, as this site applied it
        "sync_interval_s": node.cfg.averaging.sync_interval_s,
        "first_step_s": stats.first_step_s,
        "first_round_s": federation.first_round_s if federation else None,
        "reachability": swarm.reachability if swarm else "direct",
        "rejoins": swarm.entry.rejoins if swarm else 0,
        "connections": node.connections,
        "median_round_s": rounds[len(rounds) // 2] if rounds else None,
        "wire_rounds": dict(federation.wire_rounds) if federation else {},
        "measured_mbit": swarm.averager.measured_mbit if swarm else None,
        "median_agreement_s": statistics.median(agreement) if agreement else None,
        "world_size": node.world.world_size,
        # a live signal: its source (never a secret), polls, outages and the windows it gave
        "signal": node.schedule.describe() if hasattr(node.schedule, "describe") else None,
        # policy: deadline: the work, what the plan decided and why, whether it met the deadline
        "deadline": node.schedule.plan() if hasattr(node.schedule, "plan") else None,
        # data.sharding: claim: the shards it holds and how far the swarm has read them
        "shards": node.shards.summary() if node.shards is not None else None,
    }


def write_summary(node: RunningSite, path: Path, said: str = "finished") -> dict[str, Any]:
    """Write the site's summary to ``path``, log its headline figures (after ``said``) and return it."""
    result = summary(node)
    path.write_text(json.dumps(result, indent=2))
    headline = {k: result[k] for k in ("outer_round", "tokens", "energy_kwh", "emissions_g")}
    node.log.info("%s: %s", said, json.dumps(headline))
    return result


def log_transition(node: RunningSite, old: SiteState, now: float) -> None:
    """Say that the site moved from ``old`` to its current state at clock time ``now``, and why."""
    window = node.schedule.current(now)
    until = f" (window until {utc_minute(window.end)})" if window else ""
    node.log.info(
        "%s -> %s at %s%s after %d local steps",
        old.value,
        node.state.value,
        utc_minute(now),
        until,
        node.stats.local_steps,
    )


class StatusLine:
    """The periodic log line (:func:`status_line`), every ``every_s`` wall seconds at most."""

    def __init__(self, every_s: float):
        self.every_s, self.last = every_s, 0.0

    def maybe_log(self, node: RunningSite) -> None:
        if time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            node.log.info("%s", status_line(node))
