"""``greenswarm demo``: a bootstrap peer and three sites on this machine, replaying a day of grid intensity.

Everything is real except the clock: separate processes, real p2pd daemons on 127.0.0.1, real DHT
records and averaging rounds, a real (tiny) causal LM trained on the CPU. The trace is replayed
faster than real time, so a day of windows opening and closing takes a few minutes. The demo writes
each site's config to a work directory and starts the sites with ``greenswarm node``, exactly as an
operator would.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from greenswarm.averaging.config import LOOPBACK_TIMEOUTS
from greenswarm.errors import GreenswarmError
from greenswarm.procs import raise_if_terminated, reap_children

SWARM = "greenswarm-demo"
#: the longest the sites may take to start (imports, model, DHT); the replay begins as soon as all
#: of them are ready, however long that took on this machine
STARTUP_TIMEOUT_S = 300.0
#: config fields the demo sets per site (with swarm.* and scheduler.clock.*): --set may not override them
PER_SITE = ("name", "region", "node.run_dir", "scheduler.trace")
EVAL_BATCHES = 8  # held-out batches of 8 x 128 tokens each site scores the global model on
START_LEAD_S = 1.0  # wall seconds between the start file and the replay's start: every site sees it


@dataclass
class DemoOptions:
    trace: str | None = None
    regions: str | None = None
    threshold: float = 100.0
    minutes: float = 2.5
    hours: float | None = None
    sync_minutes: float = 30.0
    seed: int = 0  # the model's initialisation and the data's order (model.seed, data.seed)
    overrides: list[str] = field(default_factory=list)  # --set KEY=VALUE, for every site
    workdir: str | None = None
    as_json: bool = False
    live: bool = True


def _site_name(region: str) -> str:
    return "site-" + region.lower().replace("_", "-")


def plan_sites(opts: DemoOptions) -> tuple[Any, list[str], float, float]:
    """Check the demo's inputs before starting anything: (trace, regions, replay hours, speed-up)."""
    from greenswarm.traces import load_trace

    if opts.regions and not opts.trace:
        trace = load_trace("builtin")
    else:
        trace = load_trace(opts.trace or "builtin")
    regions = [r.strip() for r in opts.regions.split(",")] if opts.regions else trace.regions[:3]
    missing = [r for r in regions if r not in trace.regions]
    if missing:
        raise GreenswarmError(
            f"--regions: {', '.join(missing)} not in {trace.source}; it has: {', '.join(trace.regions)}"
        )
    if not 1 <= len(regions) <= 6 or len(set(regions)) != len(regions):
        raise GreenswarmError("--regions: give 1 to 6 distinct regions (the demo runs one site per region)")
    span_h = (trace.end - trace.start) / 3600
    hours = min(opts.hours or span_h, span_h)
    if opts.minutes <= 0 or hours <= 0:
        raise GreenswarmError("--minutes and --hours must be > 0")
    if opts.seed < 0:
        raise GreenswarmError(f"--seed must be >= 0, got {opts.seed}")
    for override in opts.overrides:  # what the demo sets per site is not one value for all
        key = override.partition("=")[0].strip()
        if key in PER_SITE or key.startswith(("swarm.", "scheduler.clock.")):
            raise GreenswarmError(f"--set {override}: the demo sets {key} for each site itself")
    speedup = hours * 3600 / (opts.minutes * 60)
    return trace, regions, hours, speedup


def _site_config(
    opts: DemoOptions,
    trace_spec: str,
    region: str,
    peers: list[str],
    speedup: float,
    start_file: Path,
    workdir: Path,
) -> dict[str, Any]:
    name = _site_name(region)
    # a round every sync_minutes of trace time, but never less than ~3 wall seconds
    sync_s = max(opts.sync_minutes * 60, 3.0 * speedup)
    return {
        "name": name,
        "region": region,
        "swarm": {"name": SWARM, "initial_peers": peers, "host_maddrs": ["/ip4/127.0.0.1/tcp/0"]},
        "model": {"preset": "tiny", "seed": opts.seed},
        # the standard library's sources, cut into 16 shards that the sites claim through the swarm
        # (the last held out): `greenswarm progress --shards` shows who reads which
        "data": {
            "source": "stdlib",
            "seq_len": 128,
            "seed": opts.seed,
            "sharding": "claim",
            "num_shards": 16,
            "lease_s": 10.0,
            "claim_settle_s": 0.5,
        },
        "train": {"batch_size": 8, "micro_batch_size": 8, "threads": 1, "lr": 1e-3, "warmup_steps": 20},
        # the global model's held-out loss (on the held-out shard, 8 x 8 x 128 tokens) after every outer
        # step (further apart where that takes over eval.max_share of the time), beside training, and at
        # the end: what the closing table and report.json show
        "eval": {"batches": EVAL_BATCHES, "batch_size": 8},
        "scheduler": {
            "trace": trace_spec,
            "threshold": opts.threshold,
            "clock": {"kind": "replay", "speedup": speedup, "start_file": str(start_file)},
        },
        # the plain average of the sites' models: a demo round holds tens of inner steps, where DiLoCo's
        # Nesterov outer step (tuned for hundreds) overshoots, most of all for a site alone; measured by
        # benchmarks/swarm_vs_single.py (docs/quality.md). --set averaging.outer=diloco for the other
        "averaging": {"outer": "fedavg", "sync_interval_s": sync_s, **LOOPBACK_TIMEOUTS},
        "node": {
            "run_dir": str(workdir / name),
            "progress_refresh_s": 1.0,
            "progress_ttl_s": 10.0,
            "log_every_s": 5.0,
        },
    }


class _Children:
    """The demo's child processes, each in its own session so its p2pd daemons die with it."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str], log: Path | None) -> subprocess.Popen:
        out = open(log, "w") if log else subprocess.PIPE  # noqa: SIM115  (closed with the process)
        proc = subprocess.Popen(
            [sys.executable, "-m", "greenswarm", *args],
            stdout=out,
            stderr=subprocess.STDOUT if log else subprocess.PIPE,
            start_new_session=True,
            text=True,
        )
        self.procs[name] = proc
        return proc

    def stop_all(self, grace: float = 15.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():  # whatever is left, with its whole session (p2pd included)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        reap_children()


def _start_bootstrap(children: _Children, workdir: Path) -> list[str]:
    proc = children.start(
        "bootstrap",
        [
            "bootstrap",
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--identity",
            str(workdir / "bootstrap.key"),
            "--swarm",
            SWARM,
            "--json",
        ],
        None,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("{"):
            return json.loads(line)["initial_peers"]
        if not line and proc.poll() is not None:
            raise GreenswarmError(f"the bootstrap peer exited: {proc.stderr.read().strip()[-400:]}")
    raise GreenswarmError("the bootstrap peer did not start within 60 s")


def _start_replay(children: _Children, workdir: Path, start_file: Path, live: bool) -> float:
    """Start the replay once every site has joined the swarm and waits for it (the sites share one
    start, and none misses the first windows because this machine was slow to start it); return it."""
    from rich.console import Console

    status = Console(stderr=True).status("starting the sites") if live else contextlib.nullcontext()
    with status as shown:
        return _wait_and_start(children, workdir, start_file, shown)


def _wait_and_start(children: _Children, workdir: Path, start_file: Path, shown: Any) -> float:
    from greenswarm.scheduler.clock import WAITING_FOR_START, write_start_file

    sites = [name for name in children.procs if name != "bootstrap"]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        raise_if_terminated()
        waiting = []
        for name in sites:
            log = workdir / "logs" / f"{name}.log"
            if WAITING_FOR_START in log.read_text(errors="replace"):
                continue
            if children.procs[name].poll() is not None:
                raise GreenswarmError(f"{name} exited while starting; see its log: {log}")
            waiting.append(name)
        if not waiting:
            break
        if shown is not None:
            shown.update(f"starting the sites: {len(sites) - len(waiting)} of {len(sites)} ready")
        if time.monotonic() > deadline:
            raise GreenswarmError(
                f"{', '.join(waiting)} did not start within {STARTUP_TIMEOUT_S:.0f} s; see {workdir / 'logs'}"
            )
        time.sleep(0.2)
    start_wall = time.time() + START_LEAD_S
    write_start_file(start_file, start_wall)
    return start_wall


def run_demo(opts: DemoOptions) -> int:
    trace, regions, hours, speedup = plan_sites(opts)
    workdir = Path(opts.workdir or tempfile.mkdtemp(prefix="greenswarm-demo-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "logs").mkdir(exist_ok=True)
    trace_spec = str(Path(opts.trace).resolve()) if opts.trace else "builtin"
    children = _Children()
    started = time.monotonic()
    try:
        peers = _start_bootstrap(children, workdir)
        start_file = workdir / "replay.start"
        start_file.unlink(missing_ok=True)  # a reused work directory: the last run's start is not this one's
        for region in regions:
            cfg = _site_config(opts, trace_spec, region, peers, speedup, start_file, workdir)
            path = workdir / f"{cfg['name']}.yaml"
            path.write_text(yaml.safe_dump(cfg, sort_keys=False))
            sets = [arg for override in opts.overrides for arg in ("--set", override)]
            if sets:  # a wrong --set is one line naming it, before any site starts
                from greenswarm.node.config import load_site_config

                load_site_config(path, opts.overrides)
            children.start(
                cfg["name"], ["node", "--config", str(path), *sets], workdir / "logs" / f"{cfg['name']}.log"
            )
        start_wall = _start_replay(children, workdir, start_file, opts.live)
        end_wall = start_wall + hours * 3600 / speedup
        from greenswarm.demo_view import watch_demo

        watch_demo(peers, SWARM, children.procs, trace, speedup, start_wall, end_wall, live=opts.live)
        failed = {n: p.returncode for n, p in children.procs.items() if n != "bootstrap" and p.returncode}
        if failed:
            logs = "; ".join(f"{n}: see {workdir / 'logs' / (n + '.log')}" for n in failed)
            raise GreenswarmError(f"site(s) failed with exit codes {failed} ({logs})")
    finally:
        children.stop_all()
    report = build_report(workdir, regions, trace, speedup, start_wall, hours, opts)
    report["wall_seconds"] = round(time.monotonic() - started, 1)
    report["workdir"] = str(workdir)
    report["report_html"] = _html_report(workdir, regions)
    (workdir / "report.json").write_text(json.dumps(report, indent=2))
    if opts.as_json:
        print(json.dumps(report, indent=2))
    else:
        from greenswarm.demo_view import print_report

        print_report(report)
    return 0


def _html_report(workdir: Path, regions: list[str]) -> str | None:
    """The run report of the demo's sites (``greenswarm report``) beside report.json; its path, or None
    (said in one line on stderr) when it could not be written.

    Any exception is caught, not only :class:`GreenswarmError`: the report is drawn after the run, so a
    matplotlib or numpy error (an odd run directory, a backend problem) must not turn a run that
    succeeded into a traceback and a failing exit code. ``greenswarm report WORKDIR`` redraws it.
    """
    out = workdir / "report.html"
    try:
        from greenswarm.report.build import write_report

        return write_report([workdir / _site_name(r) for r in regions], out)["out"]
    except Exception as err:  # any: the run's outcome stands (see the docstring)
        why = (str(err).splitlines() or [""])[0] or "no message"
        print(
            f"greenswarm demo: the run report {out} was not written: {type(err).__name__}: {why}",
            file=sys.stderr,
        )
        return None


def build_report(
    workdir: Path,
    regions: list[str],
    trace: Any,
    speedup: float,
    start_wall: float,
    hours: float,
    opts: DemoOptions,
) -> dict[str, Any]:
    """Per-site and total figures from the sites' summaries, with single-site baselines for context."""
    from greenswarm.scheduler.config import ANCHOR_TRAIN_KW
    from greenswarm.scheduler.energy import baseline_emissions_g
    from greenswarm.scheduler.policy import ThresholdPolicy, WindowSchedule

    sites = []
    for region in regions:
        path = workdir / _site_name(region) / "summary.json"
        if not path.exists():
            raise GreenswarmError(
                f"{_site_name(region)} wrote no summary ({path}); see its log in {workdir}/logs"
            )
        summary = json.loads(path.read_text())
        schedule = WindowSchedule(trace, region, ThresholdPolicy(opts.threshold))
        summary["share_in_window"] = schedule.share_in_window()
        sites.append(summary)
    t0, t1 = trace.start, trace.start + hours * 3600
    kw = ANCHOR_TRAIN_KW
    totals = {
        key: sum(s[key] or 0 for s in sites)
        for key in (
            "tokens",
            "local_steps",
            "energy_kwh",
            "emissions_g",
            "federated_rounds",
            "solo_rounds",
            "failed_rounds",
            "catch_ups",
        )
    }
    baselines = {r: baseline_emissions_g(trace, r, t0, t1, kw) for r in regions}
    # equal work: the same site training at once from the start, for as long as it trained in windows
    equal_work = {}
    for s in sites:
        trained = sum(s["seconds_by_state"].get(k, 0.0) for k in ("SOLO", "FEDERATED"))
        equal_work[s["site"]] = baseline_emissions_g(trace, s["region"], t0, t0 + trained, kw)
    return {
        "trace": trace.source,
        "regions": regions,
        "seed": opts.seed,
        "overrides": list(opts.overrides),
        "threshold": opts.threshold,
        "hours": hours,
        "speedup": round(speedup, 1),
        "sites": sites,
        "total": totals,
        "baseline_continuous_g": baselines,
        "baseline_equal_work_g": equal_work,
        "emissions_vs_baseline": {r: totals["emissions_g"] / b if b else None for r, b in baselines.items()},
        "quality": swarm_quality(sites, totals),
    }


def swarm_quality(sites: list[dict[str, Any]], totals: dict[str, Any]) -> dict[str, Any] | None:
    """What the swarm got: the held-out loss of the newest global model a site ended with (the outer
    step most sites hold, on a tie), which sites hold it and whether they measured the same loss (on
    the same held-out tokens), and the tokens the swarm trained. None when no site measured one
    (``eval.batches: 0``)."""
    measured = [s for s in sites if s.get("eval_loss") is not None and s.get("eval_digest")]
    if not measured:
        return None

    def holders(digest: str) -> list[dict[str, Any]]:
        return [s for s in measured if s["eval_digest"] == digest]

    best = max(measured, key=lambda s: (s["eval_round"], len(holders(s["eval_digest"]))))
    held = holders(best["eval_digest"])
    loss = best["eval_loss"]
    same_set = [s for s in held if s.get("eval_set") == best.get("eval_set")]
    return {
        "eval_loss": loss,
        "perplexity": best.get("eval_perplexity"),
        "outer_round": best["eval_round"],
        "digest": best["eval_digest"],
        "sites": [s["site"] for s in held],
        # the same global model measured at each of them on the same tokens gives the same bits
        # (global_eval.py); repr, so that NaN equals NaN
        "identical": len({repr(s["eval_loss"]) for s in same_set}) == 1,
        "held_out_set": best.get("eval_set"),
        "held_out_tokens": best.get("eval_tokens"),
        # every token the swarm's sites trained (a site that ended on another lineage or behind counts
        # too); the part still in a site's local progress at the end (trained since its last outer
        # step, in no global model) is named beside it
        "tokens": totals["tokens"],
        "tokens_not_averaged": sum(s.get("tokens_since_sync") or 0 for s in sites),
        "emissions_g": totals["emissions_g"],
    }
