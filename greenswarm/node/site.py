"""The site node: train while the grid is green, average with whoever else is, sleep otherwise.

The main loop reads like the algorithm (see :meth:`SiteNode._loop`). Everything else is a component
with its own timing, wired together here:

* :class:`~greenswarm.node.global_state.GlobalState` -- the global model and its place in the swarm;
* :class:`~greenswarm.node.round_handling.RoundHandler` -- how a round ends, alone or federated
  (:class:`~greenswarm.node.federation.Federation`), and
  :class:`~greenswarm.node.state_sync.StateSync` -- catch-up and resync;
* :class:`~greenswarm.node.ranks.SiteRanks` -- under ``torchrun`` every rank builds the model and
  trains; rank 0 alone talks to the swarm and names each collective the other ranks run next;
* :mod:`~greenswarm.node.joining` -- the DHT and the parts that talk through it;
* :mod:`~greenswarm.node.telemetry` -- counters, progress record, log line and summary;
* window checks, energy accounting, checkpoints and held-out evaluation.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from greenswarm.averaging.agreement import state_digest
from greenswarm.averaging.outer import OuterOptimizer
from greenswarm.faults import FaultPlan
from greenswarm.network import daemon_gone
from greenswarm.node.config import SiteConfig
from greenswarm.node.distributed import World
from greenswarm.node.evaluation import HeldOut
from greenswarm.node.export import describe_model
from greenswarm.node.federation import Federation
from greenswarm.node.global_eval import GlobalEvaluator, Snapshot
from greenswarm.node.global_state import GlobalState
from greenswarm.node.history import History
from greenswarm.node.joining import SwarmParts, join_swarm, refuse_other_models
from greenswarm.node.metrics import SiteMetrics, serve_site_metrics
from greenswarm.node.pacing import StepPace
from greenswarm.node.ranks import SiteRanks
from greenswarm.node.releasing import Releaser
from greenswarm.node.round_handling import (
    RoundEnd,
    RoundHandler,
    boundary_round_done,
    overlapped_matchmaking_s,
    round_search_s,
)
from greenswarm.node.round_log import RoundLog
from greenswarm.node.shard_claims import ShardClaims, claimable_shards
from greenswarm.node.shard_reader import dataset_settings
from greenswarm.node.shard_records import dataset_id
from greenswarm.node.site_checkpoints import SiteCheckpoints
from greenswarm.node.site_stats import SiteStats
from greenswarm.node.state_sync import StateSync, attested
from greenswarm.node.telemetry import StatusLine, log_transition, progress_record, summary, write_summary
from greenswarm.node.trainer import InnerTrainer
from greenswarm.scheduler.clock import WAITING_FOR_START
from greenswarm.scheduler.deadline_schedule import DeadlineSchedule
from greenswarm.scheduler.energy import EnergyLedger, make_power_model
from greenswarm.scheduler.live import LiveSchedule
from greenswarm.scheduler.policy import Window, WindowSchedule, noticed_late_s
from greenswarm.scheduler.site_schedule import site_schedule
from greenswarm.scheduler.state import SiteState, decide_state
from greenswarm.security.certificates import CertificateError
from greenswarm.timefmt import parse_instant, utc_minute

IDLE, SOLO, FEDERATED = SiteState.IDLE, SiteState.SOLO, SiteState.FEDERATED
RELEASED, RESTARTING = SiteState.RELEASED, SiteState.RESTARTING
#: how long a stopping node waits for a held-out measurement under way before its own last one
FINAL_EVAL_WAIT_S = 300.0


class SiteNode:
    """One site of the swarm (all of its ranks)."""

    def __init__(self, cfg: SiteConfig, world: World | None = None, supervised: bool = False):
        self.cfg = cfg
        self.world = world or World.from_environment(cfg.train.device)
        self.log = logging.getLogger(f"greenswarm.site.{cfg.name}")
        self._stop = threading.Event()
        self.started = time.monotonic()

        # windows, clock, energy: every rank knows them; only rank 0 acts on them (and polls a live signal)
        self.schedule, self.clock = site_schedule(
            cfg.scheduler, cfg.region, cfg.load_trace, self.log, poll=self.world.is_leader
        )
        power = make_power_model(cfg.energy, on_gpu=self.world.device.type == "cuda")
        static = isinstance(self.schedule, WindowSchedule)  # a live signal is booked as observed so far
        signal = self.schedule.trace if static else lambda: self.schedule.trace
        self.ledger = EnergyLedger(signal, cfg.region, power, start=self.clock.now())
        self.stop_at = parse_instant(cfg.node.stop_at) if cfg.node.stop_at else math.inf
        self.releaser = Releaser(
            cfg, self.schedule, self.clock, self.ledger, self.log,
            world_size=self.world.world_size, supervised=supervised,
        )  # fmt: skip
        self._releasing = False  # the loop ended for a release
        self.faults = FaultPlan.from_env()
        self.faults.record = str(Path(cfg.node.run_dir) / "faults.jsonl")  # when a fault fires, and where
        self.trainer = InnerTrainer(cfg.model, cfg.data, cfg.train, self.world, self.faults)
        self.releaser.mark("model built")
        self.ranks = SiteRanks(self.world, self.trainer)
        self.evaluator = self._evaluator()  # the global model's held-out loss (rank 0, eval.batches)
        self.round_log = RoundLog(cfg.node.run_dir, self.started)

        # the site's place in the swarm (rank 0; the swarm's parts exist once it has joined)
        self.state = IDLE
        self.stats = SiteStats()
        self.global_state: GlobalState  # set in _start, from the model's parameters
        self.swarm: SwarmParts | None = None
        self.shards: ShardClaims | None = None  # data.sharding: claim, once the site has joined
        self.federation: Federation | None = None
        self.round_handler: RoundHandler
        self.sync: StateSync
        self.checkpoints: SiteCheckpoints | None = None
        self.peer_id = ""
        self.membership = None  # this site's checked membership certificate, when it has one
        self.connections: dict[str, list[str]] = {}  # snapshot after the last successful round
        self._slot = -1
        self._window: Window | None = None  # the window the site was in at its last state decision
        self._begin_s = 0.0  # how long beginning the round in flight held training up
        self._step_s: deque[float] = deque(maxlen=8)  # the last inner steps' wall seconds (paced: apart)
        self.pace = StepPace(cfg.train.max_steps_per_s)
        self._said_matchmaking = False
        self._status = StatusLine(cfg.node.log_every_s)
        self.metrics: SiteMetrics | None = None  # node.metrics_port: Prometheus, from the start of run
        self.history = History(cfg.node.run_dir, cfg.node.log_every_s)  # what a run report reads
        if isinstance(self.schedule, DeadlineSchedule):  # the plan counts the work this site has done
            self.schedule.bind(self._work_done, peers=self._plan_peers, refresh_peers=self._read_peers)

    # ------------------------------------------------------------------ public

    def request_stop(self) -> None:
        """Ask the node to finish (signal handlers call this): it checkpoints and leaves cleanly."""
        self._stop.set()

    def run(self) -> dict[str, Any] | None:
        """Run until the trace ends or a stop is requested; return the site's summary (rank 0)."""
        if not self.world.is_leader:
            self.ranks.follow()
            return None
        try:
            self.metrics = serve_site_metrics(self)  # before joining: a port in use fails at once
            self._start()
            if self._replay_started():
                self._loop()
            if self._releasing and not self._stop.is_set():
                self._release()  # the trainer ends; the supervisor starts it again at the next window
                return None
            summary = self._finish()
            if (why := self._revoked()) is not None:  # (its last checkpoint and summary are written)
                raise CertificateError(
                    f"this site is no longer a member of swarm '{self.cfg.swarm.name}': {why}"
                )
            return summary
        finally:
            self._close()

    def summary(self) -> dict[str, Any]:
        return summary(self)

    # ------------------------------------------------------------------ the algorithm

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = self.clock.now()
            if self.cfg.node.stop_at_trace_end and now >= self.schedule.end:
                self.log.info("trace ends at %s: stopping", utc_minute(self.schedule.end))
                break
            if now >= self.stop_at:
                self.log.info("node.stop_at %s reached: stopping", utc_minute(self.stop_at))
                break
            if self._revoked() is not None:
                break
            state = self._update_state(now)
            if isinstance(self.schedule, DeadlineSchedule) and self.schedule.finished():
                self.log.info("the deadline plan's work is done: stopping")
                break
            if state is IDLE:
                now = self.clock.now()  # (leaving the window may have waited out a round's timeouts)
                if self.schedule.current(now) is not None:
                    continue  # the next window opened meanwhile: enter it, no release
                if not self.releaser.planned:  # (a site started, or restarted after a crash, in a gap)
                    self.releaser.plan(now, after_window=False)
                if self.releaser.finishing:
                    break
                if self.releaser.due(now):
                    self._releasing = True
                    break
                self._sleep_until_window(now)
            else:
                self._train_step()
                if self.round_handler.ready():
                    self._finish_round()  # the group's result arrived while this site trained on
                # another group stepped a lineage that ranks above; alone, a presence serves one
                federated = state is FEDERATED
                if self._between_rounds() and self.sync.heal_due(self.swarm.view, in_window_only=federated):
                    self._catch_up(in_window_only=federated)
                if self._round_due() and not self._stop.is_set():  # (a stop begins no round: it leaves)
                    began = time.monotonic()  # (the poll holds training up too: the round log counts it)
                    # decide SOLO vs FEDERATED on a fresh view of the swarm (bounded: see poll_now)
                    self.swarm.view.poll_now(timeout_s=self.cfg.node.swarm_poll_s)
                    state = self._update_state(self.clock.now())
                    if state is not IDLE and not self._stop.is_set():  # (the poll may take seconds)
                        self._end_round(state, began)
            self._report()

    def _update_state(self, now: float) -> SiteState:
        """Account energy for the state held until now, then pick the state for what comes next."""
        self.ledger.advance(now, self.state)
        window = self.schedule.current(now)
        new = decide_state(window is not None, len(self.swarm.view.others_in_window()))
        if new is not self.state:
            old, self.state = self.state, new
            log_transition(self, old, now)
            # (the change's own point, before a catch-up or the last round adds theirs)
            entering = old in (IDLE, RESTARTING)
            late_s = noticed_late_s(now, entering, window, self._window, self.schedule.end)
            self.history.maybe_write(self, force=True, late_s=late_s)
            if new is IDLE and self.round_handler.in_flight is not None:
                # leaving the window: the round in flight ends first (a release after it waits for it,
                # so what the round did is counted once, in the release's checkpoint)
                slot = self.round_handler.in_flight.slot
                self.log.info("window closed with round %d in flight: it ends first", slot)
                self._finish_round()
            if entering and new is not IDLE:
                self.releaser.cancel()
                self._slot = self._slot_of(now)  # the first round ends at the next boundary
                self._catch_up(in_window_only=False)
            elif new is IDLE and old is SOLO and self.stats.tokens_since_sync:
                self._end_round(SOLO)  # the only site in a window: bank its progress as it leaves
            if new is IDLE:
                if old is RESTARTING:
                    self.releaser.restart_missed()
                self._save_and_release("its window closed")
                after = self.clock.now()  # (the round in flight may have taken seconds)
                if self.schedule.current(after) is None:  # (else the next window is here: no plan)
                    self.releaser.plan(after, left=now)
            self._report(force=True)
        self._window = window
        return self.state

    def _train_step(self) -> None:
        if self.shards is not None and not self.shards.prepare():  # no shard free for a rank yet
            self._stop.wait(self.cfg.node.idle_wall_s)
            self.ranks.idle()
            return
        began = time.monotonic()
        step = self.ranks.train()
        self.stats.add_step(step)
        if self.shards is not None:
            self.shards.after_step(step.data)
        self.pace.pause(began, self._stop)  # (train.max_steps_per_s; groupmates' steps are this far apart)
        self._step_s.append(time.monotonic() - began)
        self.round_handler.step_taken()
        if self.releaser.restart is not None:
            self.releaser.first_step(self.clock.now())
        if self.stats.first_step_s is None:
            self.stats.first_step_s = time.monotonic() - self.started
            self.log.info("first training step %.1f s after start", self.stats.first_step_s)

    def _end_round(self, state: SiteState, began: float | None = None) -> None:
        """Average (FEDERATED) or take the step alone (SOLO), then move the global model. With
        ``averaging.overlap``, a federated round only begins here and training goes on; its result
        is acted on when it arrives (:meth:`_finish_round`). ``began``: when the loop stopped training
        for this round, if before this call."""
        # the last round's result comes first (waiting for it, if need be; the wait and the poll before
        # it are in that round's line)
        finished = self._finish_round(began)
        if began is None or finished:
            began = time.monotonic()
        slot = self._slot_of(self.clock.now())
        if boundary_round_done(slot, self._slot if finished else None):
            # the round that just finished was this boundary's: the next begins at the next (a SOLO
            # step here would take this slot a second time). (Only at a boundary does a round finish
            # here: the window's close and the stop finish theirs before they bank a SOLO step)
            return
        self._slot = slot
        if self.round_handler.catch_up_due(state is FEDERATED):
            if finished:  # the view was polled before that round ended: what its group did since is news
                self.swarm.view.poll_now(timeout_s=self.cfg.node.swarm_poll_s)
            self._catch_up(in_window_only=state is FEDERATED)
        if state is FEDERATED and self.cfg.averaging.overlap:
            seconds = self._matchmaking_s()
            self.round_handler.begin(
                self._slot, self._partners, matchmaking_s=seconds, search_s=self._search_s(seconds)
            )
            self._begin_s = time.monotonic() - began
            return
        search_s = self._search_s(self.cfg.averaging.matchmaking_s)
        self._after_round(
            self.round_handler.end(state is FEDERATED, self._slot, self._partners, search_s), began
        )

    def _finish_round(self, stopped: float | None = None) -> bool:
        """Act on the round in flight, if there is one (waiting for its result when it has none yet,
        unless it can no longer finish: :meth:`_round_cannot_finish`); whether there was one.
        ``stopped``: when the loop stopped training, if before this call."""
        if self.round_handler.in_flight is None:
            return False
        # training was held up by the round's begin, and now from ``stopped`` (or now) until it is done
        began = (time.monotonic() if stopped is None else stopped) - self._begin_s
        self._after_round(self.round_handler.finish(self._round_cannot_finish), began)
        return True

    def _round_cannot_finish(self) -> str | None:
        """Why the round in flight can no longer finish, if it cannot: the site is stopping and its p2p
        daemon is gone (a Ctrl-C or a SIGTERM to the node's process group reached the daemon too).
        Waiting would only run out the round's timeouts, tens of seconds (docs/testing.md row 70)."""
        if self._stop.is_set() and daemon_gone(getattr(self.swarm.dht, "pid", None)):
            return "this site is stopping and its p2p daemon is gone: the round cannot finish"
        return None

    def _after_round(self, end: RoundEnd, began: float) -> None:
        """What follows a round's end at this site: the new global model's checkpoint and record, the
        round log's line (``began``: when the loop stopped training for this round)."""
        self._slot = max(self._slot, end.slot)
        if end.result is not None and end.result.outcome.ok:
            # who this site exchanged the round with, and how
            self.connections = self.swarm.connections_or(self.connections, self.log)
        if end.moved:
            self._after_step()
        self.round_log.write(end.entry(self.global_state, self.cfg.name, time.monotonic() - began))
        if end.took_part:
            self.faults.round_done()

    def _matchmaking_s(self) -> float:
        """How long this overlapped round looks for its group: at least one of this site's recent
        inner steps (groupmates reach the boundary up to a step apart; see
        :func:`overlapped_matchmaking_s`), said once when that is longer than configured."""
        averaging = self.cfg.averaging
        interval_s = self.clock.wall_seconds(averaging.sync_interval_s)  # (a replayed trace runs faster)
        seconds = overlapped_matchmaking_s(averaging.matchmaking_s, self._step_s, interval_s)
        if seconds > averaging.matchmaking_s and not self._said_matchmaking:
            self._said_matchmaking = True
            self.log.info(
                "inner steps take up to %.1f s, longer than averaging.matchmaking_s (%g s): overlapped "
                "rounds look for their group for %.1f s (in the background)",
                max(self._step_s), averaging.matchmaking_s, seconds,
            )  # fmt: skip
        return seconds

    def _search_s(self, matchmaking_s: float) -> float:
        """How long this round's group stays open to latecomers: it ends in time for a catch-up before
        the next boundary (:func:`round_search_s`; a replayed trace's boundaries come sooner in wall
        seconds)."""
        next_boundary = (self._slot + 1) * self.cfg.averaging.sync_interval_s
        until_s = self.clock.wall_seconds(max(next_boundary - self.clock.now(), 0.0))
        return round_search_s(matchmaking_s, until_s)

    def _partners(self) -> int:
        """How many other sites are in a window now (a round expects every one of them)."""
        return len(self.swarm.view.others_in_window())

    def _between_rounds(self) -> bool:
        """No round in flight, and the next boundary not yet due (a catch-up then would only be redone)."""
        return self.round_handler.in_flight is None and not self._round_due()

    def _catch_up(self, in_window_only: bool) -> None:
        """Adopt a more advanced global state held by a live site, if there is one."""
        if self.sync.catch_up(self.swarm.view, in_window_only):
            self.stats.counts["catch_ups"] += 1
            self._report(force=True)

    def _verify_served(self, meta: dict[str, Any], tensors: list, server: str) -> str | None:
        """Why a state ``server`` served is not to be adopted (see
        :func:`~greenswarm.node.state_sync.attested`), from fresh records of the state's holders: a
        holder that just stepped may serve its new state a moment before its record says so, so the
        records are read again for up to two seconds before a state nobody attests is refused."""
        digest = state_digest(tensors)
        where = (meta.get("outer_round"), meta.get("lineage"))
        for attempt in range(5):
            self.swarm.view.poll_now()
            holders = [r for r in self.swarm.view.others() if (r.outer_round, r.lineage) == where]
            why = attested(digest, server, holders)
            if why is None or any(r.state_digest for r in holders) or attempt == 4:
                return why
            time.sleep(0.5)
        return why

    def _refused_state(self, _peer: str, _why: str) -> None:
        """A state a peer served was refused (:meth:`_verify_served`; the sync said whose and why)."""
        self.stats.counts["refused_states"] += 1

    def _save_and_release(self, why: str) -> None:
        """The site leaves its window: its newest state goes to disk (a checkpoint cadence may have
        skipped the last step; idle is the cheapest time to write it), and with claimed shards it
        writes one regardless, so that the positions it publishes hold everything its readers read,
        and then lets its shards go to sites still in a window."""
        if self.shards is None or not self.shards.held:
            self.checkpoints.save_if_behind()
            return
        self.checkpoints.save()
        self.shards.release_all(why)

    def _after_step(self) -> None:
        """What follows every change of the global model: checkpoint, held-out loss and the best
        checkpoints (when due), kept copy, record, fresh view."""
        self.checkpoints.after_step(self._evaluate)
        self._report(force=True)
        self.swarm.view.refresh()

    # ------------------------------------------------------------------ held-out evaluation

    def _evaluator(self) -> GlobalEvaluator | None:
        """Rank 0's evaluator of the global model, when ``eval.batches`` asks for one. ``eval.device:
        auto`` puts its copy where rank 0 trains on a one-rank site, and on the CPU on a sharded one
        (sharded because its GPUs have no room for a whole copy)."""
        cfg = self.cfg
        if not cfg.eval.enabled or not self.world.is_leader:
            return None
        device = cfg.eval.device
        if device == "auto":
            device = "cpu" if self.world.distributed else self.world.device
        trainer = self.trainer
        return GlobalEvaluator(
            cfg.eval,
            cfg.model,
            HeldOut(cfg.eval, cfg.data, trainer.tokenizer),
            trainer.tokenizer.vocab_size,
            numel=sum(shape.numel() for shape in trainer.shapes),
            device=device,
            run_dir=cfg.node.run_dir,
        )

    def _evaluate(self, wait: bool = False) -> float | None:
        """Measure the global model as it is now. Beside training (``eval.background``), returning
        None: the loss is published when done. Or, with ``wait``, ``eval.keep_best`` (the checkpoint it
        keeps must be the one measured) or no background, the loss itself (None if it failed): on a
        one-rank site measured here; on a sharded one on the evaluator's thread while the other ranks
        idle (rank 0 alone measures, and their collectives must not time out meanwhile)."""
        snapshot = self._snapshot()
        if snapshot is None:
            return None
        evaluator, eval_cfg = self.evaluator, self.cfg.eval
        if not (wait or eval_cfg.keep_best or not eval_cfg.background):
            evaluator.submit(snapshot)
            return None
        if self.world.distributed:
            evaluator.submit(snapshot)
            self._wait_for_evaluator()
            result = evaluator.result_of(snapshot)
        else:
            result = evaluator.submit(snapshot, here=True)
        return None if result is None else result.loss

    def _wait_for_evaluator(self, timeout_s: float = math.inf) -> bool:
        """Wait until the evaluator's thread is done, the other ranks idling meanwhile (their
        collectives must not time out while rank 0 alone measures); whether it was in ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.evaluator.drain(timeout=self.cfg.node.idle_wall_s):
            if time.monotonic() > deadline:
                return False
            self.ranks.idle()
        return True

    def _snapshot(self) -> Snapshot | None:
        """The global state's model values, position and digest, all of one state (None if it kept
        moving: nothing moves it where the node measures, so this is a guard, not a path)."""
        state = self.global_state
        where = state.where()
        digest = state.digest()  # (takes the lock itself: before it is held here)
        with state.lock:
            if state.where() != where:
                self.log.warning("the global state moved while it was taken: not measured this time")
                return None
            flat = state.params[: self.evaluator.numel].clone()
        outer_round, lineage, _ = where
        return Snapshot(flat, outer_round, lineage, digest, self.stats.tokens, self.clock.now())

    def _take_evaluations(self) -> None:
        """Publish the held-out losses measured since the last call (the record, the log, the summary)."""
        if self.evaluator is None:
            return
        for done in self.evaluator.finished():
            self.checkpoints.best.pace.measured(done.seconds)  # (how far apart the next ones go)
            stats = self.stats
            stats.eval_loss, stats.eval_round = done.loss, done.outer_round
            stats.eval_digest, stats.eval_tokens, stats.eval_set = (
                done.digest,
                done.held_out_tokens,
                done.held_out_set,
            )
            self.log.info(
                "outer step %d (%s): held-out loss %.4f, perplexity %.2f (%d tokens, %.1f s)",
                done.outer_round, done.digest, done.loss, done.perplexity or math.nan, done.held_out_tokens,
                done.seconds,
            )  # fmt: skip

    def _evaluate_last(self) -> None:
        """At the end of a run: measure the global model it ends with, unless that one already was (or
        the site never trained: a stop before its replay began). A background measurement still under
        way gets ``FINAL_EVAL_WAIT_S`` to end; a stop must not hang on it."""
        evaluator, state = self.evaluator, self.global_state
        if evaluator is None or (self.stats.local_steps == 0 and state.outer_round == 0):
            return
        if not self._wait_for_evaluator(FINAL_EVAL_WAIT_S):
            self.log.warning("the held-out evaluation under way did not end in %.0f s", FINAL_EVAL_WAIT_S)
            return
        if not evaluator.measured((state.outer_round, state.lineage, state.digest())):
            self._evaluate(wait=True)
        self._take_evaluations()

    # ------------------------------------------------------------------ wiring and timing

    def _start(self) -> None:
        cfg = self.cfg
        averaging = cfg.averaging
        outer = OuterOptimizer.from_config(
            self.ranks.gather(),
            averaging.outer,
            averaging.outer_lr,
            averaging.outer_momentum,
            averaging.nesterov,
        )
        self.global_state = GlobalState(outer, cfg.name)
        self.global_state.averaging = self.trainer.averaging_weights
        self.sync = StateSync(
            self.global_state,
            self.ranks,
            lambda peers: self.swarm.averager.download_state(peers),  # once the site has joined
            self._stop,
            averaging.agreement_timeout_s,
            self.log,
            verify=self._verify_served,
        )
        self.sync.on_refused = self._refused_state
        self.checkpoints = SiteCheckpoints(
            cfg, self.faults, self.ranks, self.global_state, self.sync, self.stats, self.ledger, self.log,
            background=averaging.overlap,  # rounds beside training: checkpoints written beside it too
        )  # fmt: skip
        # (the metrics count from the restored totals: a restarted site's counters start at 0)
        with self.metrics.restoring() if self.metrics is not None else contextlib.nullcontext():
            resumed = self.checkpoints.resume()
        self.releaser.mark("checkpoint loaded")
        if resumed and self.releaser.resume(self.clock.now(), self.checkpoints.state_digest):
            self.state = RESTARTING  # (booked at training power until its first decision)
            self.releaser.mark("state digest checked")
        elif resumed and (gap := self.ledger.skip_to(self.clock.now())) > 0:
            self.log.info(
                "energy: not booking the %.1f h between the checkpoint and this start (the site's draw "
                "then is unknown)",
                gap / 3600.0,
            )
        # where continued pretraining starts, on the held-out shard its loss will be measured on
        if not resumed and cfg.model.init_from is not None and self.evaluator is not None:
            if (loss := self._evaluate(wait=True)) is not None:
                self.log.info("held-out loss of the starting model (%s): %.4f", cfg.model.source, loss)
            self._take_evaluations()
        if cfg.train.schedule_free and cfg.averaging.outer == "diloco" and cfg.averaging.outer_momentum:
            self.log.warning(
                "train.optimizer: adamw-schedulefree under averaging.outer: diloco: the outer momentum "
                "carries the optimizer's z, which takes the raw steps, far past its average x; "
                "benchmarks/schedule_free.py measured it well behind averaging.outer: fedavg "
                "(docs/schedule_free.md, 'Which outer step')"
            )
        trainer = self.trainer  # what ``greenswarm export`` needs to turn checkpoints into a model directory
        describe_model(
            cfg.node.run_dir, trainer.model, trainer.names, trainer.shapes, cfg.model, trainer.identity
        )
        self.swarm, self.membership = join_swarm(
            cfg, outer.numel, self.global_state.served, self.faults, self.log, self.trainer.identity
        )
        self.peer_id = self.swarm.peer_id
        self.releaser.mark("joined the swarm")
        refuse_other_models(
            self.swarm.view, self.trainer.identity, cfg.name, cfg.swarm.name, cfg.node.progress_ttl_s
        )
        if cfg.data.claimed:
            self.shards = self._claims()
        parts = (self.swarm.averager, self.swarm.digests, averaging, cfg.name, self.peer_id)
        interval_s = self.clock.wall_seconds(averaging.sync_interval_s)  # (a replay runs faster)
        self.federation = Federation(*parts, self.faults, self.started, self.log, interval_s)
        self.round_handler = RoundHandler(
            self.global_state, self.ranks, self.federation, self.sync, self.stats, self.peer_id, self.log
        )
        self.log.info(
            "site %s (%s) joined swarm '%s' as %s; %s (%s), %d rank(s)",
            cfg.name,
            cfg.region,
            cfg.swarm.name,
            self.peer_id,
            self.trainer.identity,
            cfg.model.source,
            self.world.world_size,
        )
        self._report(force=True)

    def _claims(self) -> ShardClaims:
        """data.sharding: claim: this site's claims on the swarm's shards, with the shards its readers
        held at the checkpoint it resumed taken back where no other site took them over."""
        cfg = self.cfg
        claimable, excluded = claimable_shards(cfg.data, cfg.eval)
        settings = dataset_settings(cfg.data, self.trainer.tokenizer, self.trainer.batches.files())
        dataset = dataset_id(settings, excluded)
        claims = ShardClaims(
            self.swarm.dht, cfg.swarm.name, self.swarm.publisher.subkey, cfg.name, self.peer_id, dataset,
            cfg.data.num_shards, claimable, self.world.world_size, cfg.data.lease_s, cfg.data.claim_settle_s,
            self.ranks.assign, cfg.node.run_dir, self.log,
        )  # fmt: skip
        self.log.info(
            "data %r: claims its shards through the swarm (dataset %s: %d shards, %d claimable, "
            "held out: %s)",
            cfg.data.source,
            dataset,
            cfg.data.num_shards,
            len(claimable),
            ", ".join(map(str, excluded)) or "none",
        )
        self.checkpoints.shards = claims
        claims.start(self.ranks.data_status() or [], self.checkpoints.resumed_shards)
        return claims

    def _replay_started(self) -> bool:
        """Wait for a replay whose start comes from a start file: whoever launched the sites writes it
        once every site has logged that it is ready (this line); a stop request ends the wait."""
        if not self.clock.started:
            self.log.info("%s (%s)", WAITING_FOR_START, self.cfg.scheduler.clock.start_file)
        return self.clock.wait_for_start(self._stop)

    def _report(self, force: bool = False) -> None:
        """Progress record (when due or forced), the entry-point watch, a periodic log line and history."""
        self._take_evaluations()
        if self.swarm is not None:
            self.swarm.entry.poll()
            self.swarm.publisher.maybe_publish(lambda: progress_record(self), force=force)
        self._status.maybe_log(self)
        self.history.maybe_write(self, force)

    def _sleep_until_window(self, now: float) -> None:
        """IDLE: no training; wake at the next window, a poll, or a stop (bounded wall sleeps). Shards
        held while IDLE (a site restarted outside its window takes its readers' shards back) go to sites
        in a window."""
        if self.shards is not None and self.shards.held:
            self._save_and_release("outside its window")
        nxt = self.schedule.next_window(now)
        target = min(
            nxt.start if nxt else self.schedule.end,
            now + self.cfg.scheduler.poll_s,
            self.stop_at,
            self.releaser.release_at,
        )
        self.clock.sleep_until(target, max_wall_s=self.cfg.node.idle_wall_s)
        self.ranks.idle()  # keeps follower ranks' collectives from timing out during long idles

    def _revoked(self) -> str | None:
        """Why the swarm's authority revoked this site (it then stops), or None."""
        watch = self.swarm.revocations if self.swarm is not None else None
        return watch.revoked_self if watch is not None else None

    def _work_done(self) -> tuple[float, int]:
        """Clock seconds this site has trained (its ledger's, restored with a checkpoint) and its tokens."""
        trained = self.ledger.seconds[SOLO.value] + self.ledger.seconds[FEDERATED.value]
        return trained, self.stats.tokens

    def _plan_peers(self) -> list[tuple[str, int, dict | None]]:
        """The other sites' names, tokens and published plans, from their progress records (a shared
        deadline)."""
        if self.swarm is None:
            return []
        return [(r.site, r.tokens, r.plan) for r in self.swarm.view.others()]

    def _read_peers(self) -> None:
        """Read the others' progress records now (a shared deadline plan's new decision), unless the
        view read them within a tenth of its poll period; bounded as the round's own read is (see
        :meth:`SwarmView.poll_now`). (Each read is a DHT round trip: under a replay with short plan
        steps, a read at every step would leave the loop little else to do.)"""
        if self.swarm is not None:
            poll_s = self.cfg.node.swarm_poll_s
            self.swarm.view.poll_if_older(poll_s / 10.0, timeout_s=poll_s)

    def _slot_of(self, t: float) -> int:
        return int(t // self.cfg.averaging.sync_interval_s)

    def _round_due(self) -> bool:
        return self._slot_of(self.clock.now()) > self._slot

    def _finish(self) -> dict[str, Any]:
        self.releaser.ended()
        self._finish_round()
        now = self.clock.now()
        if self.state is SOLO and self.stats.tokens_since_sync:
            self._end_round(SOLO)
        self.ledger.advance(now, self.state)
        self.releaser.finished(now)
        if self.state is not IDLE:
            self.log.info("%s -> IDLE (stopping)", self.state.value)
        self.state = IDLE
        self.checkpoints.save()
        if self.shards is not None:
            self.shards.release_all("stopping")
        self._evaluate_last()
        self._report(force=True)
        self.swarm.publisher.flush()
        return write_summary(self, Path(self.cfg.node.run_dir) / "summary.json")

    def _release(self) -> None:
        """End the trainer for the gap: book the wait, write a checkpoint (ledger included), let the
        shards go, publish the last record, leave the marker the supervisor and the next start read."""
        now = self.clock.now()
        self._finish_round()
        self.ledger.advance(now, self.state)
        began = time.monotonic()
        self.checkpoints.save()
        if self.shards is not None:
            self.shards.release_all("its trainer is released")
        checkpoint_s = time.monotonic() - began
        saved = self.clock.now()
        digest = self.checkpoints.state_digest()
        write_summary(self, Path(self.cfg.node.run_dir) / "summary.json", "released, the run so far")
        old, self.state = self.state, RELEASED
        # the agent's presence stands for the site meanwhile: it publishes this record (RELEASED, the
        # planned restart) and serves the checkpoint's global state (greenswarm.node.presence)
        self.releaser.release(now, saved, checkpoint_s, digest, lambda: progress_record(self).to_wire())
        self.history.maybe_write(self, force=True)
        log_transition(self, old, now)
        self.swarm.publisher.publish_final(progress_record(self), self.cfg.node.progress_ttl_s)

    def _close(self) -> None:
        if isinstance(self.schedule, LiveSchedule | DeadlineSchedule):
            self.schedule.close()
        if self.checkpoints is not None:
            self.checkpoints.close()
        if self.evaluator is not None:
            self.evaluator.close()
        if self.shards is not None:
            self.shards.close()
        self.ranks.stop()
        if self.swarm is not None:
            self.swarm.close(self.log)
        if self.metrics is not None:
            self.metrics.close()
