"""The global model's held-out loss, measured beside training on a copy of its own.

What a user asks first after "what did it emit?" is "what did I get?": the swarm's answer is the
held-out loss of the *global* model, the one every site holding the same digest holds. This module
measures exactly that, and measures it so that the number is a property of the model, not of the
site that measured it:

* **the global state's own bits.** The evaluator takes a copy of the global parameters (for a
  schedule-free swarm, ``x``: the first part of the flat vector) the moment an outer step lands, and
  loads it into a model of its own, unsharded, on rank 0. The site's training model -- sharded over
  ranks, in schedule-free's ``y``, or already some inner steps past the global model under overlapped
  rounds -- is never touched, and no other rank takes part.
* **the same tokens every time.** :class:`~greenswarm.node.evaluation.HeldOut`'s fixed batches of the
  held-out shard, read once, summed in one order, in fp32 (no autocast). Two sites holding the same
  digest therefore report bit-identical losses on the same hardware and thread count (a test checks
  it); a GPU and a CPU site may differ in the last bits.
* **off the training path.** With ``eval.background`` (the default) the measurement runs on a thread
  of its own while the loop trains on; only the newest state waiting is measured when a slow
  evaluation falls behind a fast swarm (an older one would only be outdated). With ``eval.keep_best``
  the loop waits for the loss instead: the checkpoint it keeps must be the one measured.

Results come back to the loop through :meth:`GlobalEvaluator.finished`, which the node turns into its
progress record's ``eval_loss``, a line of ``run_dir/evals.jsonl`` and its summary.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from greenswarm.node.evaluation import EvalConfig, HeldOut
from greenswarm.node.model import ModelConfig, build_model, causal_lm_loss

log = logging.getLogger(__name__)

EVALS_FILE = "evals.jsonl"


@dataclass(frozen=True)
class Snapshot:
    """One global state to measure: its bits and where it stands."""

    flat: torch.Tensor  # the model's parameters (schedule-free: x), a private copy
    outer_round: int
    lineage: str
    digest: str  # GlobalState.digest() of the whole state it came from
    tokens: int  # this site's trained tokens when it was taken
    clock_time: float

    @property
    def key(self) -> tuple[int, str, str]:
        return (self.outer_round, self.lineage, self.digest)


@dataclass(frozen=True)
class Evaluation:
    """The held-out loss of one global state, and what it was measured on."""

    outer_round: int
    lineage: str
    digest: str
    loss: float
    held_out_tokens: int  # predicted tokens the loss averages over
    held_out_set: str  # fingerprint of the held-out tokens: one loss per digest holds within one set
    tokens: int  # this site's trained tokens when the state was taken
    clock_time: float  # the site's clock (trace time) when the state was taken
    wall_time: float  # when the measurement ended
    seconds: float  # how long it took

    @property
    def perplexity(self) -> float | None:
        return perplexity(self.loss)

    @property
    def key(self) -> tuple[int, str, str]:
        return (self.outer_round, self.lineage, self.digest)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "perplexity": self.perplexity}


def perplexity(loss: float | None) -> float | None:
    """``exp(loss)``: inf where it overflows, None for no loss or a loss that is not a number."""
    if loss is None or math.isnan(loss):
        return None
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


class GlobalEvaluator:
    """Measures held-out losses of global states on its own copy of the model (rank 0 only).

    ``numel``: how many leading values of the global vector are the model (the rest, for a
    schedule-free ``x+z`` state, is ``z``). ``device``: where the copy lives.

    Memory: the model copy, and up to two snapshots of the model (one being measured, one waiting).
    """

    def __init__(
        self,
        cfg: EvalConfig,
        model_cfg: ModelConfig,
        held_out: HeldOut,
        vocab_size: int,
        numel: int,
        device: torch.device | str,
        run_dir: str | Path | None = None,
    ):
        self.cfg = cfg
        self.held_out, self.numel, self.device = held_out, numel, torch.device(device)
        self.path = Path(run_dir) / EVALS_FILE if run_dir is not None else None
        self.last: Evaluation | None = None  # the newest measured
        # built here, on the caller's thread: a model that does not fit fails at the start, not in the
        # background hours later (and its seeded build never runs beside training)
        self._model = build_model(model_cfg, vocab_size, device=self.device)
        self._model.eval()
        for param in self._model.parameters():
            param.requires_grad_(False)
        self._pending: Snapshot | None = None
        self._busy = False
        self._done: list[Evaluation] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    # ---- what the node calls

    def submit(self, snapshot: Snapshot, here: bool = False) -> Evaluation | None:
        """Measure ``snapshot``: ``here`` and now (after any measurement under way), returning the
        evaluation, or None when it failed (said in a warning); else on the evaluator's thread, and
        None (:meth:`finished` gives it back when done)."""
        if here:
            self.drain()  # (the older one first: results arrive in order, and the model is free)
            return self._measure_or_warn(snapshot)
        with self._cond:
            if self._pending is not None:
                log.debug("outer step %d not measured: a newer state came first", self._pending.outer_round)
            self._pending = snapshot
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="held-out-eval", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return None

    def result_of(self, snapshot: Snapshot) -> Evaluation | None:
        """The newest evaluation if it is of ``snapshot``'s state, else None."""
        last = self.last
        return last if last is not None and last.key == snapshot.key else None

    def measured(self, key: tuple[int, str, str]) -> bool:
        """Whether the newest evaluation that succeeded is of the state ``(outer step, lineage,
        digest)`` (call :meth:`drain` first: the end of a run measures only what is new)."""
        return self.last is not None and self.last.key == key

    def finished(self) -> list[Evaluation]:
        """The evaluations that ended since the last call, oldest first."""
        with self._cond:
            done, self._done = self._done, []
        return done

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until nothing is pending or being measured; whether that happened in ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """End the thread (a measurement under way finishes; one still waiting is dropped)."""
        with self._cond:
            self._closed, self._pending = True, None
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    # ---- the measurement

    def _work(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                snapshot, self._pending, self._busy = self._pending, None, True
            try:
                self._measure_or_warn(snapshot)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _measure_or_warn(self, snapshot: Snapshot) -> Evaluation | None:
        """Measure, never ending the node: a failure (out of memory, an unreadable held-out shard) is
        one warning, and the next state is measured all the same."""
        try:
            result = self._measure(snapshot)
        except Exception as e:
            log.warning("held-out evaluation of outer step %d failed: %s", snapshot.outer_round, e)
            return None
        with self._cond:
            self._done.append(result)
        return result

    def _measure(self, snapshot: Snapshot) -> Evaluation:
        began = time.monotonic()
        loss, tokens = self.loss_of(snapshot.flat)
        result = Evaluation(
            outer_round=snapshot.outer_round,
            lineage=snapshot.lineage,
            digest=snapshot.digest,
            loss=loss,
            held_out_tokens=tokens,
            held_out_set=self.held_out.fingerprint(),
            tokens=snapshot.tokens,
            clock_time=snapshot.clock_time,
            wall_time=time.time(),
            seconds=time.monotonic() - began,
        )
        self.last = result
        self._append(result)
        return result

    @torch.no_grad()
    def loss_of(self, flat: torch.Tensor) -> tuple[float, int]:
        """The mean next-token loss of the model holding ``flat`` (its first ``numel`` values) over the
        held-out batches, and how many tokens it predicted: fp32, the batches in order, on this
        evaluator's model alone."""
        batches = self.held_out.batches()
        if not batches:
            raise ValueError("no held-out batches: the held-out shard is empty")
        model = self._model
        if flat.numel() < self.numel:
            raise ValueError(
                f"the global vector holds {flat.numel()} values, fewer than the model's {self.numel}"
            )
        offset = 0
        for param in model.parameters():
            n = param.numel()
            param.copy_(flat[offset : offset + n].view_as(param))
            offset += n
        total, tokens = 0.0, 0
        for batch in batches:
            batch = batch.to(self.device)
            predicted = batch[:, 1:].numel()
            total += float(causal_lm_loss(model, batch)) * predicted
            tokens += predicted
        return total / tokens, tokens

    def _append(self, result: Evaluation) -> None:
        if self.path is None:
            return
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(result.to_json(), allow_nan=True) + "\n")
        except OSError as e:  # a full disk costs the file's line, never the measurement
            log.warning("could not append to %s: %s", self.path, e)
