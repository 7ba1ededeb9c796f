"""The site node: train while the grid is green, average with whoever else is, sleep otherwise.

The main loop reads like the algorithm (see :meth:`SiteNode._loop`). Everything else -- window
checks, energy accounting, progress records, checkpoints, catching up with the swarm -- is a
component or a short method with its own timing.

Under ``torchrun`` every rank builds the model and trains; rank 0 alone talks to the swarm and tells
the other ranks, one command at a time, which collective to run next (:meth:`_collective`).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from greenswarm.averaging.agreement import DigestBoard, Verdict, decide, state_digest
from greenswarm.averaging.averager import RoundOutcome, SwarmAverager
from greenswarm.averaging.outer import GENESIS, OuterOptimizer, next_lineage
from greenswarm.averaging.screening import update_norm
from greenswarm.bootstrap.identity import identity_seed, load_or_create_identity
from greenswarm.errors import ConfigError
from greenswarm.faults import FaultPlan
from greenswarm.network import relay_options, resolve_reachability, run_in_dht, start_dht
from greenswarm.node.checkpoint import Checkpointer
from greenswarm.node.config import SiteConfig
from greenswarm.node.distributed import World
from greenswarm.node.evaluation import BestCheckpoints, HeldOut
from greenswarm.node.progress import ProgressPublisher, ProgressRecord, live_members, record_validators
from greenswarm.node.rejoin import EntryWatch
from greenswarm.node.round_log import RoundEntry, RoundLog
from greenswarm.node.swarm_view import SwarmView, state_key
from greenswarm.node.trainer import InnerTrainer
from greenswarm.scheduler.clock import WAITING_FOR_START, make_clock
from greenswarm.scheduler.energy import EnergyLedger, make_power_model
from greenswarm.scheduler.policy import WindowSchedule
from greenswarm.scheduler.state import SiteState, decide_state
from greenswarm.security.admission import Admission
from greenswarm.traces import load_trace

IDLE, SOLO, FEDERATED = SiteState.IDLE, SiteState.SOLO, SiteState.FEDERATED
#: wall seconds beyond a round's timeouts that its checkpoint and evaluation may take while the site's
#: record is kept alive (past that, a loop that does not come back lets the record expire)
KEEPALIVE_SLACK_S = 60.0


def _fmt_clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%MZ", time.gmtime(t))


class SiteNode:
    """One site of the swarm (all of its ranks)."""

    def __init__(self, cfg: SiteConfig, world: World | None = None):
        self.cfg = cfg
        self.world = world or World.from_environment(cfg.train.device)
        self.log = logging.getLogger(f"greenswarm.site.{cfg.name}")
        self._stop = threading.Event()
        self._state_lock = threading.Lock()  # guards the global view while it is served to peers
        self.started = time.monotonic()

        # windows, clock, energy: every rank knows them; only rank 0 acts on them
        trace = load_trace(cfg.scheduler.trace, **cfg.scheduler.trace_options())
        if cfg.region not in trace.regions:
            raise ConfigError(
                f"{cfg.region!r} is not in trace {trace.source}; it has: {', '.join(trace.regions)}",
                field="region",
            )
        self.trace = trace
        self.schedule = WindowSchedule(trace, cfg.region, cfg.scheduler.window_policy())
        self.clock = make_clock(cfg.scheduler.clock, trace.start)
        self.ledger = EnergyLedger(
            trace,
            cfg.region,
            make_power_model(cfg.energy, on_gpu=self.world.device.type == "cuda"),
            start=self.clock.now(),
        )
        self.faults = FaultPlan.from_env()
        self.faults.record = str(Path(cfg.node.run_dir) / "faults.jsonl")  # when a fault fires, and where
        self.trainer = InnerTrainer(cfg.model, cfg.data, cfg.train, self.world, self.faults)

        # the site's state in the swarm
        self.state = IDLE
        self.outer_round, self.lineage, self.round_index = 0, GENESIS, -1
        self.local_steps = self.tokens = self.tokens_since_sync = 0
        self.loss: float | None = None
        # the first step's loss: where this site started, untrained or from the swarm's model it
        # adopted on entering its first window (the summary's loss is an EMA that moves slowly from it)
        self.first_loss: float | None = None
        self.counts = {
            "federated_rounds": 0,
            "solo_rounds": 0,
            "failed_rounds": 0,
            "catch_ups": 0,
            "resyncs": 0,
            "refused_updates": 0,  # groupmates' updates refused before averaging (NaN/Inf, outsized)
        }
        self.round_seconds: list[float] = []
        self.agreement_seconds: list[float] = []  # digest + exchange + decision, per averaged round
        self.wire = ""  # the wire format of the last averaged round
        self.wire_rounds: dict[str, int] = {}  # averaged rounds by wire format
        self.first_step_s: float | None = None
        self.first_round_s: float | None = None
        self.reachability = "direct"  # decided when the site joins the swarm
        self.connections: dict[str, list[str]] = {}  # snapshot after the last successful round
        self._slot = -1
        self._last_log = 0.0
        self.peer_id = ""

        self.checkpointer = Checkpointer(Path(cfg.node.run_dir), self.faults)
        self.held_out = HeldOut(cfg.eval, cfg.data, self.trainer.tokenizer)
        self.best = BestCheckpoints(cfg.eval, self.checkpointer) if self.world.is_leader else None
        self.eval_loss: float | None = None  # the global model's held-out loss at its last evaluation
        self.outer: OuterOptimizer | None = None
        self.rounds = RoundLog(cfg.node.run_dir, self.started)
        self.membership = None  # this site's checked membership certificate, when it has one
        self.admission: Admission | None = None  # who may train with this site (None: anyone)
        self.recent_update_norm = 0.0  # norm of the last update applied to the global model
        self.dht = self.averager = self.view = self.publisher = self.digests = self.entry = None

    # ------------------------------------------------------------------ public

    def request_stop(self) -> None:
        """Ask the node to finish (signal handlers call this): it checkpoints and leaves cleanly."""
        self._stop.set()

    def run(self) -> dict[str, Any] | None:
        """Run until the trace ends or a stop is requested; return the site's summary (rank 0)."""
        if not self.world.is_leader:
            self._follow()
            return None
        try:
            self._start()
            if self._replay_started():
                self._loop()
            return self._finish()
        finally:
            self._close()

    def _replay_started(self) -> bool:
        """Wait for a replay whose start comes from a start file: whoever launched the sites writes it
        once every site has logged that it is ready (this line); a stop request ends the wait."""
        if not self.clock.started:
            self.log.info("%s (%s)", WAITING_FOR_START, self.cfg.scheduler.clock.start_file)
        return self.clock.wait_for_start(self._stop)

    # ------------------------------------------------------------------ the algorithm

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = self.clock.now()
            if self.cfg.node.stop_at_trace_end and now >= self.trace.end:
                self.log.info("trace ends at %s: stopping", _fmt_clock(self.trace.end))
                break
            state = self._update_state(now)
            if state is IDLE:
                self._sleep_until_window(now)
            else:
                self._train_step()
                if self._round_due():
                    self.view.poll_now()  # decide SOLO vs FEDERATED on a fresh view of the swarm
                    state = self._update_state(self.clock.now())
                    if state is not IDLE:
                        self._end_round(state)
            self._report()

    def _update_state(self, now: float) -> SiteState:
        """Account energy for the state held until now, then pick the state for what comes next."""
        self.ledger.advance(now, self.state)
        in_window = self.schedule.in_window(now)
        new = decide_state(in_window, len(self.view.others_in_window()))
        if new is not self.state:
            old, self.state = self.state, new
            window = self.schedule.current(now)
            until = f" (window until {_fmt_clock(window.end)})" if window else ""
            self.log.info(
                "%s -> %s at %s%s after %d local steps",
                old.value,
                new.value,
                _fmt_clock(now),
                until,
                self.local_steps,
            )
            if old is IDLE:
                self._slot = self._slot_of(now)  # the first round ends at the next boundary
                self._catch_up(in_window_only=False)
            elif new is IDLE and old is SOLO and self.tokens_since_sync:
                self._end_round(SOLO)  # the only site in a window: bank its progress as it leaves
            self._report(force=True)
        return self.state

    def _train_step(self) -> None:
        stats = self._collective("train")
        if self.first_step_s is None:
            self.first_step_s = time.monotonic() - self.started
            self.log.info("first training step %.1f s after start", self.first_step_s)
        self.local_steps += 1
        self.tokens += stats.tokens
        self.tokens_since_sync += stats.tokens
        if self.first_loss is None:
            self.first_loss = stats.loss
        self.loss = stats.loss if self.loss is None else 0.9 * self.loss + 0.1 * stats.loss

    def _end_round(self, state: SiteState) -> None:
        """Average (FEDERATED) or take the step alone (SOLO), then move the global model."""
        began = time.monotonic()
        self._slot = self._slot_of(self.clock.now())
        if state is FEDERATED:
            self._catch_up(in_window_only=True)
        local = self._collective("gather")
        delta = self.outer.pseudo_gradient(local)
        outcome = verdict = None
        if state is FEDERATED:
            outcome = self._average(delta)
            if outcome.ok:
                self._slot = outcome.slot  # the group's slot: names the round the same for every member
            verdict = self._agree(outcome, delta) if outcome.ok else None
            if verdict is not None and verdict.action == "resync":
                resynced = self._resync(outcome, verdict)
                why = "" if resynced else "could not get the majority's state"
                self._log_round("resync" if resynced else "fail", began, outcome, verdict, reason=why)
                if resynced:
                    self.faults.round_done()
                return
            if verdict is None or verdict.action != "apply":
                self.counts["failed_rounds"] += 1
                why = outcome.reason if verdict is None else verdict.reason
                self.log.warning(
                    "round %d: %s (%s); keeping local progress, retrying next round",
                    self._slot,
                    "averaging failed" if verdict is None else "the group did not agree on the result",
                    why,
                )
                self._log_round("fail", began, outcome, verdict, reason=why)
                return
            averaged, members = outcome.averaged, outcome.members
            self._keep_residual(outcome)
        else:
            averaged, members = delta, [self.peer_id]
        with self._state_lock:
            self.outer.step(averaged)
            self.recent_update_norm = update_norm(averaged)
            self.outer_round += 1
            self.lineage = next_lineage(self.lineage, self._slot, members)
            self.round_index = self._slot
        self._collective("load", self.outer.params)
        self.tokens_since_sync = 0
        self.counts["federated_rounds" if len(members) > 1 else "solo_rounds"] += 1
        self.log.info(
            "round %d: outer step %d %s, loss %.3f, global digest %s",
            self._slot,
            self.outer_round,
            f"averaged with {len(members) - 1} site(s)" if len(members) > 1 else "alone",
            self.loss or float("nan"),
            self.outer.digest(),
        )
        self._after_step()
        self._log_round("solo" if outcome is None else "apply", began, outcome, verdict)
        if outcome is not None:
            self.faults.round_done()

    def _log_round(
        self,
        action: str,
        began: float,
        outcome: RoundOutcome | None,
        verdict: Verdict | None,
        reason: str = "",
    ) -> None:
        """One line of the round log (``run_dir/rounds.jsonl``): what this round did, and its timings."""
        members = [_site_of(outcome, p) for p in outcome.members] if outcome and outcome.ok else []
        self.rounds.write(
            RoundEntry(
                slot=self._slot,
                action=action,
                outer_round=self.outer_round,
                lineage=self.lineage,
                digest=self.outer.digest(),
                members=sorted(members) or [self.cfg.name],
                reason=reason,
                refused={_site_of(outcome, p): why for p, why in outcome.refused.items()} if outcome else {},
                wire=outcome.wire if outcome else "",
                round_s=outcome.seconds if outcome else None,
                allreduce_s=outcome.allreduce_s if outcome else None,
                agreement_s=self.agreement_seconds[-1] if verdict is not None else None,
                blocked_s=time.monotonic() - began,
            )
        )

    def _after_step(self) -> None:
        """What follows every change of the global model: checkpoint, held-out loss and the best
        checkpoints (when due), kept copy, record, fresh view."""
        self._save_checkpoint()
        loss = self.best.after_step(self.outer_round, self.lineage, lambda: self._collective("evaluate"))
        if loss is not None:
            self.eval_loss = loss
            self.log.info("outer step %d: held-out loss %.4f", self.outer_round, loss)
        self._keep_global()
        self._report(force=True)
        self.view.refresh()

    def _keep_global(self) -> None:
        """Keep this outer step's global model if ``node.keep_globals`` asks (named by step and lineage)."""
        keep = self.cfg.node.keep_globals
        if not keep:
            return
        directory = Path(self.cfg.node.run_dir) / "globals"
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(self.outer.params.clone(), directory / f"outer-{self.outer_round:06d}-{self.lineage}.pt")
        for old in sorted(directory.glob("outer-*.pt"))[:-keep]:
            old.unlink(missing_ok=True)

    def _average(self, delta: torch.Tensor) -> RoundOutcome:
        # after _catch_up no site in a window is ahead of this one, and those behind catch up to it before
        # they average, so every site in a window is expected in the group (a group of the ones in
        # step now would fill up and shut out a site that is catching up at this very boundary)
        partners = self.view.others_in_window()
        if not partners:
            return RoundOutcome(False, reason="no other site is in a window any more")
        outcome = self.averager.average(
            delta if self.feedback is None else delta + self.feedback,
            weight=self.tokens_since_sync,
            round_index=self._slot,
            lineage=self.lineage,
            expected_size=1 + len(partners),
            gather={
                "site": self.cfg.name,
                "tokens": self.tokens_since_sync,
                "outer_round": self.outer_round,
                "recent": self.recent_update_norm,  # the scale the group screens updates against
            },
        )
        for peer, why in outcome.refused.items():
            self._note_refusal(outcome, peer, why)
        if outcome.ok:
            self.round_seconds.append(outcome.seconds)
            self.wire = outcome.wire
            self.wire_rounds[outcome.wire] = self.wire_rounds.get(outcome.wire, 0) + 1
            if self.first_round_s is None:
                self.first_round_s = time.monotonic() - self.started
                self.log.info("first averaging round completed %.1f s after start", self.first_round_s)
            self.connections = self._connections()  # who this site exchanged the round with, and how
        return outcome

    def _note_refusal(self, outcome: RoundOutcome, peer: str, why: str) -> None:
        """A groupmate's update was refused before it was averaged: count it and say so."""
        self.counts["refused_updates"] += 1
        self.log.warning("round %d: refused the update of %s: %s", self._slot, _site_of(outcome, peer), why)

    def _agree(self, outcome: RoundOutcome, delta: torch.Tensor) -> Verdict:
        """Prove with the group that every member is about to apply the same step (see
        :mod:`greenswarm.averaging.agreement`)."""
        averaged = outcome.averaged
        if self.faults.fires("corrupt-result"):
            n = max(1, averaged.numel() // 10)
            averaged[:n] = delta[:n]  # as if the part reduced elsewhere had been lost
            self.log.warning("fault injected: corrupt-result (first %d values not averaged)", n)
        started = time.monotonic()
        with self._state_lock:
            digest = state_digest([*self.outer.state_tensors(), averaged])
        publish = not self.faults.fires("withhold-digest")
        if not publish:
            self.log.warning("fault injected: withhold-digest (this site's digest is not published)")
        published = self.digests.exchange(
            self._slot,
            self.lineage,
            outcome.members,
            digest,
            timeout_s=self.cfg.averaging.agreement_timeout_s,
            publish=publish,
            refused=outcome.refused,
        )
        for peer, why in self.digests.heard_refused.items():  # refused by a groupmate's reducer
            if peer not in outcome.refused and peer != self.peer_id:
                outcome.refused[peer] = why
                self._note_refusal(outcome, peer, why)
        verdict = decide(self.peer_id, digest, published, outcome.members)
        self.agreement_seconds.append(time.monotonic() - started)
        self.log.debug(
            "round %d: %s after %.2f s of digest exchange (%s)",
            self._slot,
            verdict.action,
            time.monotonic() - started,
            verdict.reason,
        )
        return verdict

    def _keep_residual(self, outcome: RoundOutcome) -> None:
        """The round's result is this site's now: carry what coding left out of it into the next."""
        if self.feedback is not None and outcome.residual is not None:
            self.feedback.copy_(outcome.residual)

    def _resync(self, outcome: RoundOutcome, verdict: Verdict) -> bool:
        """This site's round result disagreed with the majority: take the majority's state after their
        step (this site's pseudo-gradient is already in it, so local progress is not kept)."""
        expected = next_lineage(self.lineage, self._slot, outcome.members)
        self.log.warning("round %d: %s; resynchronizing from %s", self._slot, verdict.reason, verdict.holders)
        deadline = time.monotonic() + self.cfg.averaging.agreement_timeout_s
        while not self._stop.is_set():
            got = self.averager.download_state(verdict.holders)
            if (
                got is not None
                and got[0].get("lineage") == expected
                and self._adopt(*got, keep_pending=False)
            ):
                self._keep_residual(outcome)
                self.counts["resyncs"] += 1
                self.tokens_since_sync = 0
                self.log.info(
                    "round %d: resynchronized to outer step %d, global digest %s",
                    self._slot,
                    self.outer_round,
                    self.outer.digest(),
                )
                self._after_step()
                return True
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)  # the majority may not have applied its step yet
        self.counts["failed_rounds"] += 1
        self.log.warning(
            "round %d: could not get the majority's state; keeping local progress, catching up later",
            self._slot,
        )
        return False

    def _catch_up(self, in_window_only: bool) -> bool:
        """If a live site holds a more advanced global state, download it and rebase local progress."""
        head = self.view.head(in_window_only=in_window_only)
        if head is None or state_key(head.outer_round, head.lineage) <= state_key(
            self.outer_round, self.lineage
        ):
            return False
        started = time.monotonic()
        sources = self.view.holders_of(head.outer_round, head.lineage)
        got = self.averager.download_state(sources)
        if got is None:
            self.log.warning(
                "could not download the state of round %d from %s; training on", head.outer_round, head.site
            )
            return False
        if not self._adopt(*got, keep_pending=True):
            return False
        self.counts["catch_ups"] += 1
        self.log.info(
            "caught up with %s: global state of outer step %d in %.2f s; local progress kept",
            got[0].get("site", head.site),
            self.outer_round,
            time.monotonic() - started,
        )
        self._report(force=True)
        return True

    def _adopt(self, meta: dict[str, Any], tensors: list[torch.Tensor], keep_pending: bool) -> bool:
        """Make a downloaded global state this site's; keep the local progress made since this site's
        last outer step on top of it only when ``keep_pending`` (it is not yet in that state)."""
        if len(tensors) != 2 or any(t.numel() != self.outer.numel for t in tensors):
            self.log.warning("%s served a state of the wrong shape; ignoring it", meta.get("site", "a peer"))
            return False
        pending = self.outer.pseudo_gradient(self._collective("gather")) if keep_pending else None
        with self._state_lock:
            self.outer.load_state_tensors(tensors)
            self.outer_round, self.lineage = int(meta["outer_round"]), str(meta["lineage"])
            self.round_index = int(meta["round_index"])
        self._collective("load", self.outer.params if pending is None else self.outer.params - pending)
        return True

    # ------------------------------------------------------------------ components and helpers

    def _start(self) -> None:
        cfg = self.cfg
        self.outer = OuterOptimizer.from_config(
            self._collective("gather"),
            cfg.averaging.outer,
            cfg.averaging.outer_lr,
            cfg.averaging.outer_momentum,
            cfg.averaging.nesterov,
        )
        # error feedback: what coding left out of this site's last averaged pseudo-gradient
        self.feedback = torch.zeros(self.outer.numel) if cfg.averaging.error_feedback else None
        self._resume()
        identity = cfg.swarm.identity
        if identity:
            load_or_create_identity(identity)
        seed = None
        if cfg.swarm.certificate:
            self.admission = self._check_membership()
            seed = identity_seed(identity)
        validators = record_validators(cfg.swarm.name, self.admission, seed)
        self.reachability, why = resolve_reachability(cfg.swarm)
        how = "through a relay" if self.reachability == "relay" else "directly"
        self.log.info("joining the swarm %s: %s", how, why)
        reach: dict[str, Any] = {"announce_maddrs": cfg.swarm.announce_maddrs}
        if self.reachability == "relay":
            # behind NAT: reached through the bootstrap's relay, and a DHT client (others cannot
            # dial it for DHT queries cheaply, so it does not serve them)
            reach = {**relay_options(cfg.swarm.initial_peers), "client_mode": True}
        self.dht = start_dht(
            cfg.swarm.initial_peers,
            host_maddrs=cfg.swarm.host_maddrs,
            identity_path=identity,
            record_validators=validators,
            **reach,
        )
        self.peer_id = self.dht.peer_id.to_base58()
        self.averager = SwarmAverager(
            self.dht,
            f"{cfg.swarm.name}-avg",
            self.outer.numel,
            cfg.averaging,
            self._served_state,
            faults=self.faults,
            admission=self.admission,
            members=functools.partial(live_members, self.dht, cfg.swarm.name),
        )
        self.view = SwarmView(self.dht, cfg.swarm.name, self.peer_id, cfg.node.swarm_poll_s)
        self.digests = DigestBoard(self.dht, cfg.swarm.name, self.peer_id)
        self.entry = EntryWatch(self.dht, cfg.swarm.initial_peers, cfg.node.rejoin_s)
        self.publisher = ProgressPublisher(
            self.dht,
            cfg.swarm.name,
            validators,
            cfg.node.progress_refresh_s,
            cfg.node.progress_ttl_s,
            # a round (or the checkpoint and evaluation after it) may hold the loop this long
            keepalive_s=cfg.averaging.longest_round_s() + KEEPALIVE_SLACK_S,
        )
        self.log.info(
            "site %s (%s) joined swarm '%s' as %s; %s parameters, %d rank(s)",
            cfg.name,
            cfg.region,
            cfg.swarm.name,
            self.peer_id,
            f"{self.trainer.num_parameters:,}",
            self.world.world_size,
        )
        self._report(force=True)

    def _check_membership(self) -> Admission:
        """Refuse to start with a certificate that is not this site's, this swarm's, or valid now;
        return what the site checks its peers with (and shows them)."""
        from greenswarm.bootstrap.identity import read_identity
        from greenswarm.security.certificates import CertificateError, load_authority_public, verify

        swarm = self.cfg.swarm
        membership = verify(
            swarm.certificate,
            load_authority_public(swarm.authority),
            swarm=swarm.name,
            peer_id=read_identity(swarm.identity),
        )
        if (membership.site, membership.region) != (self.cfg.name, self.cfg.region):
            raise CertificateError(
                f"{swarm.certificate}: issued to site {membership.site!r} in {membership.region!r}, "
                f"but this config is {self.cfg.name!r} in {self.cfg.region!r}"
            )
        self.membership = membership
        self.log.info(
            "admitted to swarm '%s' until %s (certificate %s)",
            swarm.name,
            _fmt_clock(membership.expires),
            swarm.certificate,
        )
        return Admission.from_files(swarm.name, swarm.authority, swarm.certificate)

    def _resume(self) -> None:
        payload = self.checkpointer.load()
        if payload is None:
            return
        self._collective("restore", payload["trainer"])
        with self._state_lock:
            self.outer.load_state_tensors(payload["outer"])
        site = payload["site"]
        self.outer_round, self.lineage, self.round_index = (
            site["outer_round"],
            site["lineage"],
            site["round_index"],
        )
        self.local_steps, self.tokens, self.loss = site["local_steps"], site["tokens"], site["loss"]
        self.first_loss = site.get("first_loss")  # absent from checkpoints written before it was kept
        self.counts.update(site["counts"])
        self.ledger.load_state_dict(payload["ledger"])
        self.log.info(
            "resumed from %s: outer step %d, %d local steps, global digest %s",
            self.checkpointer.path,
            self.outer_round,
            self.local_steps,
            self.outer.digest(),
        )

    def _save_checkpoint(self) -> None:
        trainer_state = self._collective("save")
        with self._state_lock:
            outer = [t.clone() for t in self.outer.state_tensors()]
        self.checkpointer.save(
            {
                "trainer": trainer_state,
                "outer": outer,
                "ledger": self.ledger.state_dict(),
                "site": {
                    "outer_round": self.outer_round,
                    "lineage": self.lineage,
                    "round_index": self.round_index,
                    "local_steps": self.local_steps,
                    "tokens": self.tokens,
                    "loss": self.loss,
                    "first_loss": self.first_loss,
                    "counts": dict(self.counts),
                },
            }
        )

    def _served_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """What this site serves to a newcomer (called on hivemind's thread, hence the lock)."""
        with self._state_lock:
            meta = {
                "site": self.cfg.name,
                "outer_round": self.outer_round,
                "lineage": self.lineage,
                "round_index": self.round_index,
            }
            return meta, [t.clone() for t in self.outer.state_tensors()]

    def _record(self) -> ProgressRecord:
        now = self.clock.now()
        window = self.schedule.current(now) if self.state is not IDLE else None
        return ProgressRecord(
            site=self.cfg.name,
            region=self.cfg.region,
            state=self.state.value,
            peer_id=self.peer_id,
            outer_round=self.outer_round,
            lineage=self.lineage,
            round_index=self.round_index,
            local_steps=self.local_steps,
            tokens=self.tokens,
            loss=None if self.loss is None or not math.isfinite(self.loss) else float(self.loss),
            window_end=float(window.end) if window else None,
            energy_kwh=self.ledger.energy_kwh,
            emissions_g=self.ledger.emissions_g,
            clock_time=now,
            wall_time=time.time(),
            world_size=self.world.world_size,
            wire=self.wire or None,
            refused=self.counts["refused_updates"],
        )

    def _report(self, force: bool = False) -> None:
        """Progress record (when due or forced), the entry-point watch and a periodic log line."""
        if self.entry is not None:
            self.entry.poll()
        if self.publisher is not None:
            self.publisher.maybe_publish(self._record, force=force)
        if time.monotonic() - self._last_log >= self.cfg.node.log_every_s:
            self._last_log = time.monotonic()
            self.log.info(
                "%s at %s: outer step %d, %d steps, %s tokens, loss %s, %.3f kWh, %.1f gCO2",
                self.state.value,
                _fmt_clock(self.clock.now()),
                self.outer_round,
                self.local_steps,
                f"{self.tokens:,}",
                "-" if self.loss is None else f"{self.loss:.3f}",
                self.ledger.energy_kwh,
                self.ledger.emissions_g,
            )

    def _sleep_until_window(self, now: float) -> None:
        """IDLE: no training; wake at the next window, a poll, or a stop (bounded wall sleeps)."""
        nxt = self.schedule.next_window(now)
        target = min(nxt.start if nxt else self.trace.end, now + self.cfg.scheduler.poll_s)
        self.clock.sleep_until(target, max_wall_s=self.cfg.node.idle_wall_s)
        self._collective("idle")  # keeps follower ranks' collectives from timing out during long idles

    def _slot_of(self, t: float) -> int:
        return int(t // self.cfg.averaging.sync_interval_s)

    def _round_due(self) -> bool:
        return self._slot_of(self.clock.now()) > self._slot

    def _finish(self) -> dict[str, Any]:
        now = self.clock.now()
        if self.state is SOLO and self.tokens_since_sync:
            self._end_round(SOLO)
        self.ledger.advance(now, self.state)
        if self.state is not IDLE:
            self.log.info("%s -> IDLE (stopping)", self.state.value)
        self.state = IDLE
        self._save_checkpoint()
        self._report(force=True)
        self.publisher.flush()
        summary = self.summary()
        path = Path(self.cfg.node.run_dir) / "summary.json"
        path.write_text(json.dumps(summary, indent=2))
        self.log.info(
            "finished: %s",
            json.dumps({k: summary[k] for k in ("outer_round", "tokens", "energy_kwh", "emissions_g")}),
        )
        return summary

    def _connections(self) -> dict[str, list[str]]:
        """The peers this site's p2p daemon is connected to now, with the addresses it uses for each:
        a site behind NAT shows ``/p2p-circuit`` addresses for every other site (it never dialled
        one directly). Best effort and bounded: a diagnostic must never stall a round or a stop."""
        try:
            return run_in_dht(self.dht, _list_connections, 2.0).result(timeout=3.0)
        except Exception as err:
            self.log.debug("cannot list connections: %r", err)
            return self.connections

    def summary(self) -> dict[str, Any]:
        rounds = sorted(self.round_seconds)
        return {
            "site": self.cfg.name,
            "region": self.cfg.region,
            "peer_id": self.peer_id,
            "outer_round": self.outer_round,
            "lineage": self.lineage,
            "digest": self.outer.digest(),
            **self.counts,
            "local_steps": self.local_steps,
            "tokens": self.tokens,
            "loss": self.loss,
            "first_loss": self.first_loss,
            "eval_loss": self.eval_loss,
            "energy_kwh": self.ledger.energy_kwh,
            "emissions_g": self.ledger.emissions_g,
            "seconds_by_state": dict(self.ledger.seconds),
            "first_step_s": self.first_step_s,
            "first_round_s": self.first_round_s,
            "reachability": self.reachability,
            "rejoins": self.entry.rejoins if self.entry else 0,
            "connections": self.connections,
            "median_round_s": rounds[len(rounds) // 2] if rounds else None,
            "wire_rounds": dict(self.wire_rounds),
            "measured_mbit": self.averager.measured_mbit if self.averager else None,
            "median_agreement_s": statistics.median(self.agreement_seconds)
            if self.agreement_seconds
            else None,
            "world_size": self.world.world_size,
        }

    def _close(self) -> None:
        if self.world.distributed:
            self._collective("stop")
        for part in (self.publisher, self.view, self.averager, self.dht):
            if part is None:
                continue
            try:
                part.close() if isinstance(part, SwarmView | ProgressPublisher) else part.shutdown()
            except Exception as e:  # shutting down: report and go on with the rest
                self.log.debug("shutdown of %s failed: %r", type(part).__name__, e)

    # ------------------------------------------------------------------ rank 0 -> all ranks

    def _collective(self, op: str, arg: Any = None) -> Any:
        """Run ``op`` on every rank of the site (rank 0 announces it; followers mirror it)."""
        if self.world.distributed:
            self.world.broadcast(op)
        return self._run_op(op, arg)

    def _run_op(self, op: str, arg: Any) -> Any:
        if op == "train":
            return self.trainer.step()
        if op == "gather":
            return self.trainer.full_parameters()
        if op == "load":
            return self.trainer.load_full_parameters(arg)
        if op == "save":
            return self.trainer.state_dict()
        if op == "restore":
            return self.trainer.load_state_dict(arg)
        if op == "evaluate":
            return self.trainer.evaluate(self.held_out.batches())
        if op in ("idle", "stop"):
            return None
        raise ValueError(f"unknown site operation {op!r}")

    def _follow(self) -> None:
        """Ranks > 0: run whatever rank 0 announces until it says stop."""
        while True:
            op = self.world.broadcast(None)
            if op == "stop":
                return
            self._run_op(op, None)


def _site_of(outcome: RoundOutcome, peer: str) -> str:
    """A groupmate's site name from what it gathered (its peer id when it named none)."""
    gathered = outcome.gathered.get(peer)
    return str(gathered.get("site", peer)) if isinstance(gathered, dict) else peer


async def _list_connections(_dht: Any, node: Any) -> dict[str, list[str]]:
    """Runs inside the DHT process (see :meth:`SiteNode._connections`)."""
    return {str(peer.peer_id): [str(a) for a in peer.addrs] for peer in await node.p2p.list_peers()}
