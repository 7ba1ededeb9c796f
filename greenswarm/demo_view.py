"""What the demo shows: a live table of the sites while it runs, a report when it ends."""

from __future__ import annotations

import subprocess
import time
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from greenswarm.console import wide_console
from greenswarm.node.progress import ProgressRecord, fetch_records, open_reader
from greenswarm.node.progress_view import progress_table
from greenswarm.procs import raise_if_terminated
from greenswarm.scheduler.config import ANCHOR_TRAIN_KW
from greenswarm.timefmt import utc_minute


def _header(trace: Any, speedup: float, start_wall: float, end_wall: float) -> Group:
    now = time.time()
    clock = trace.start + (now - start_wall) * speedup
    done = min(1.0, max(0.0, (now - start_wall) / (end_wall - start_wall)))
    if now < start_wall:
        line = f"sites starting; the replay begins in {start_wall - now:.0f} s"
    else:
        line = (
            f"replaying {trace.source} at {speedup:.0f}x: {utc_minute(clock)}"
            f" ({(clock - trace.start) / 3600:.1f} of {(end_wall - start_wall) * speedup / 3600:.1f} h)"
        )
    return Group(Text(line, style="bold"), ProgressBar(total=1.0, completed=done, width=60))


def watch_demo(
    peers: list[str],
    swarm: str,
    procs: dict[str, subprocess.Popen],
    trace: Any,
    speedup: float,
    start_wall: float,
    end_wall: float,
    live: bool,
) -> None:
    """Show the swarm until every site process has exited (they stop at the end of the replay)."""
    sites = [p for name, p in procs.items() if name != "bootstrap"]
    deadline = end_wall + 120
    dht = open_reader(peers, swarm, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    console = wide_console()
    last: dict[str, ProgressRecord] = {}
    last_print = 0.0

    def render() -> Group:
        try:
            for r in fetch_records(dht, swarm):
                last[r.site] = r
        except Exception:  # a poll can fail while sites come and go; keep the last view
            pass
        return Group(
            _header(trace, speedup, start_wall, end_wall),
            progress_table(sorted(last.values(), key=lambda r: r.site)),
        )

    try:
        if live and console.is_terminal:
            with Live(render(), console=console, refresh_per_second=2) as view:
                while any(p.poll() is None for p in sites) and time.time() < deadline:
                    time.sleep(0.5)
                    raise_if_terminated()
                    view.update(render())
        else:
            while any(p.poll() is None for p in sites) and time.time() < deadline:
                time.sleep(1.0)
                raise_if_terminated()  # (a SIGTERM whose raise a library swallowed still stops the demo)
                group = render()
                if time.monotonic() - last_print >= 10:
                    last_print = time.monotonic()
                    states = ", ".join(f"{r.site} {r.state} outer {r.outer_round}" for r in last.values())
                    console.print(f"{group.renderables[0].renderables[0].plain} | {states}")
    finally:
        dht.shutdown()


def _held_out(loss: float | None, outer_round: int | None) -> str:
    if loss is None:
        return "-"
    return f"{loss:.3f}" + (f" @{outer_round}" if outer_round is not None else "")


def _perplexity(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def quality_line(quality: dict[str, Any] | None) -> str:
    """What the swarm got, in one sentence: the global model's held-out loss and perplexity, who holds
    it, what it was measured on and the tokens and emissions it took."""
    if quality is None:
        return "the global model was not evaluated (eval.batches: 0)"
    held = ", ".join(quality["sites"])
    if len(quality["sites"]) > 1:
        held += ": the same loss at each" if quality["identical"] else ": [red]different losses[/]"
    pending = quality["tokens_not_averaged"]
    rest = f" ({pending:,} of them trained after the sites' last outer steps)" if pending else ""
    return (
        f"the swarm's model (outer step {quality['outer_round']}, digest {quality['digest']}, "
        f"held by {held}): held-out loss {quality['eval_loss']:.4f}, "
        f"perplexity {quality['perplexity']:,.2f} on "
        f"{quality['held_out_tokens'] or 0:,} held-out tokens; it took {quality['tokens']:,} training "
        f"tokens{rest} and {quality['emissions_g']:,.0f} g CO2"
    )


def print_report(report: dict[str, Any]) -> None:
    console = wide_console()
    table = Table(
        title=f"greenswarm demo: {report['hours']:.1f} h of {report['trace']} "
        f"(threshold {report['threshold']:g} gCO2/kWh) in {report['wall_seconds']:.0f} s",
        header_style="bold",
    )
    for col in (
        "site",
        "region",
        "in window",
        "outer steps",
        "federated",
        "solo",
        "failed",
        "tokens",
        "loss",
        "energy kWh",
        "CO2 g",
        "held-out",
        "ppl",
    ):
        table.add_column(col, justify="left" if col in ("site", "region") else "right")
    quality = report.get("quality")
    for s in report["sites"]:
        table.add_row(
            s["site"],
            s["region"],
            f"{s['share_in_window']:.0%}",
            str(s["outer_round"]),
            str(s["federated_rounds"]),
            str(s["solo_rounds"]),
            str(s["failed_rounds"]),
            f"{s['tokens']:,}",
            "-" if s["loss"] is None else f"{s['loss']:.3f}",
            f"{s['energy_kwh']:.2f}",
            f"{s['emissions_g']:,.0f}",
            _held_out(s.get("eval_loss"), s.get("eval_round")),
            _perplexity(s.get("eval_perplexity")),
        )
    t = report["total"]
    table.add_row(
        "total",
        "",
        "",
        "",
        str(t["federated_rounds"]),
        str(t["solo_rounds"]),
        str(t["failed_rounds"]),
        f"{t['tokens']:,}",
        "",
        f"{t['energy_kwh']:.2f}",
        f"{t['emissions_g']:,.0f}",
        _held_out(quality["eval_loss"], quality["outer_round"]) if quality else "-",
        _perplexity(quality["perplexity"]) if quality else "-",
        style="bold",
    )
    console.print(table)
    console.print(quality_line(quality), highlight=False)
    lines = []
    for site in report["sites"]:
        by_state = site.get("emissions_g_by_state") or {}
        trained = sum(by_state.get(k, 0.0) for k in ("SOLO", "FEDERATED"))
        at_once = report["baseline_equal_work_g"][site["site"]]
        lines.append(
            f"  {site['site']}: {at_once:,.0f} g at once vs {trained:,.0f} g in its windows "
            f"(+{by_state.get('IDLE', 0.0):,.0f} g idle, model kept on the device)"
        )
    console.print(
        f"the same training run at once from the start ({ANCHOR_TRAIN_KW:g} kW, equal work) would emit:\n"
        + "\n".join(lines)
    )
    console.print(f"configs, logs, checkpoints and report.json: {report['workdir']}")
    if report.get("report_html"):
        console.print(f"run report (open in a browser): {report['report_html']}", highlight=False)
