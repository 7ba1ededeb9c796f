"""The ``greenswarm`` command. Each subcommand only parses its arguments and calls into a package.

Errors a user can cause (a config field, a multiaddr, an unreachable swarm) become one line on stderr
and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from greenswarm import __version__
from greenswarm.errors import ConfigError, GreenswarmError
from greenswarm.timefmt import parse_instant

if TYPE_CHECKING:
    from greenswarm.traces.trace import Trace

EPILOG = """\
a swarm across sites:
  greenswarm bootstrap --listen /ip4/0.0.0.0/tcp/31337 --identity boot.key
  greenswarm node --config site.yaml --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...
  greenswarm progress --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...

how much training time would a grid give, and what would a policy emit?
  greenswarm windows --trace mci.csv --region CAISO_NORTH --threshold 100 --plot windows.png
  greenswarm simulate --trace mci.csv --regions CAISO_NORTH,SPP_TX,NEM_SA --work 17.78 --json
  greenswarm reproduce --events exp1_events.csv --trace mci.csv

admission (who may join):
  greenswarm swarm init --key authority.key
  greenswarm swarm admit --key authority.key --site caiso-north --region CAISO_NORTH --peer-id 12D3Koo...

everything on this machine, offline, in a few minutes:
  greenswarm demo --workdir demo
  greenswarm report demo --out report.html   # (the demo writes demo/report.html itself)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="greenswarm",
        description="Pretrain language models across independent GPU sites, training only while each "
        "site's grid runs on surplus renewable electricity.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"greenswarm {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs, hivemind's included")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    boot = sub.add_parser(
        "bootstrap",
        help="run the swarm's entry point (a DHT peer and relay with a stable identity)",
        description="Run a bootstrap peer: the address sites dial first. It keeps its peer id in the "
        "identity file (created if missing, mode 0600), so its address survives restarts. It prints "
        "the exact --initial-peers value for sites.",
    )
    boot.add_argument(
        "--listen",
        nargs="+",
        default=["/ip4/0.0.0.0/tcp/31337"],
        metavar="MADDR",
        help="multiaddrs to listen on (default: /ip4/0.0.0.0/tcp/31337)",
    )
    boot.add_argument(
        "--announce",
        nargs="+",
        default=[],
        metavar="MADDR",
        help="public multiaddrs to advertise (e.g. behind a port forward)",
    )
    boot.add_argument(
        "--identity", required=True, metavar="PATH", help="identity key file (created if missing)"
    )
    boot.add_argument(
        "--initial-peers",
        nargs="+",
        default=[],
        metavar="MADDR",
        help="other bootstrap peers to join (several bootstrap peers add redundancy)",
    )
    boot.add_argument("--swarm", default="greenswarm", help="swarm name (default: greenswarm)")
    boot.add_argument(
        "--authority",
        metavar="KEY.pub",
        help="the swarm authority's public key: store only records of certified members (required "
        "for a certified swarm, see docs/security.md)",
    )
    boot.add_argument(
        "--revocations",
        metavar="FILE",
        help="the authority's revocation list (greenswarm swarm revoke): refuse the members it names, "
        "and keep the list on the DHT for the sites",
    )
    boot.add_argument(
        "--relay-port",
        type=int,
        metavar="PORT",
        help="in a certified swarm, the members-only relay's port (default: the listen port + 1)",
    )
    boot.add_argument(
        "--relay-data-gib",
        type=float,
        default=64.0,
        metavar="GIB",
        help="what one relayed connection may carry each way before the relay resets it (default 64)",
    )
    boot.add_argument(
        "--relay-hours",
        type=float,
        default=24.0,
        metavar="H",
        help="how long one relayed connection may last before the relay resets it (default 24)",
    )
    boot.add_argument(
        "--no-relay",
        action="store_true",
        help="do not relay for sites behind NAT (by default the bootstrap carries their connections)",
    )
    boot.add_argument("--json", action="store_true", help="print the peer id and addresses as JSON")
    boot.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on this port (peers, relayed connections and bytes; "
        "docs/metrics.md); off by default",
    )
    boot.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address the metrics endpoint binds (default: 127.0.0.1, this machine only)",
    )

    node = sub.add_parser(
        "node",
        help="run a site: train in curtailment windows, average with sites in theirs",
        description="Run a site node from a YAML config. Under torchrun --nproc-per-node N the model "
        "is sharded over N processes with FSDP2; rank 0 talks to the swarm.",
    )
    node.add_argument("--config", required=True, metavar="YAML", help="site config (see README)")
    node.add_argument(
        "--initial-peers",
        nargs="+",
        metavar="MADDR",
        help="bootstrap multiaddrs (override swarm.initial_peers)",
    )
    node.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set train.lr=3e-4 (repeatable)",
    )
    node.add_argument("--run-dir", metavar="DIR", help="checkpoints and summary (override node.run_dir)")

    prog = sub.add_parser(
        "progress",
        help="show every live site of a swarm",
        description="Read the swarm's signed progress records: state, outer step, steps, tokens, loss, "
        "window end, energy and emissions of every live site.",
    )
    prog.add_argument(
        "--initial-peers", nargs="+", required=True, metavar="MADDR", help="bootstrap multiaddrs"
    )
    prog.add_argument("--swarm", default="greenswarm", help="swarm name (default: greenswarm)")
    prog.add_argument(
        "--authority",
        metavar="KEY.pub",
        help="the swarm authority's public key: show only records of certified members (a certified "
        "swarm signs its records, so without it they cannot be read)",
    )
    prog.add_argument(
        "--revocations",
        metavar="FILE",
        help="the authority's revocation list (greenswarm swarm revoke): leave out the members it "
        "names (the newest list on the DHT is read too)",
    )
    prog.add_argument("--json", action="store_true", help="print records as JSON")
    prog.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    prog.add_argument(
        "--shards",
        action="store_true",
        help="show the swarm's claimed data shards instead (data.sharding: claim): each shard's epoch, "
        "how far it is read and which site holds it",
    )

    demo = sub.add_parser(
        "demo",
        help="a bootstrap peer and three sites on this machine, on a replayed trace",
        description="Start a bootstrap peer and three site nodes (separate processes, real p2pd "
        "daemons on 127.0.0.1) that train one tiny model on the CPU while replaying a day of grid "
        "intensity faster than real time; show a live table and end with a report. Offline; uses a "
        "built-in trace model unless --trace is given.",
    )
    demo.add_argument(
        "--trace", metavar="CSV", help="a wide CSV trace (timestamp column + one column per region)"
    )
    demo.add_argument(
        "--regions", metavar="A,B,C", help="the three regions (columns) to use, comma-separated"
    )
    demo.add_argument(
        "--threshold", type=float, default=100.0, help="gCO2/kWh below which a site trains (100)"
    )
    demo.add_argument(
        "--minutes", type=float, default=2.5, help="wall minutes the replay lasts (default 2.5)"
    )
    demo.add_argument("--hours", type=float, help="trace hours to replay (default: all of it, at most 24)")
    demo.add_argument(
        "--sync-minutes", type=float, default=30.0, help="trace minutes between averaging rounds (default 30)"
    )
    demo.add_argument(
        "--seed", type=int, default=0, help="the model's initialisation and the data's order (default 0)"
    )
    demo.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of every site's config, e.g. --set averaging.outer=diloco (repeatable)",
    )
    demo.add_argument("--workdir", metavar="DIR", help="keep configs, logs and checkpoints here")
    demo.add_argument("--json", action="store_true", help="print the final report as JSON")
    demo.add_argument("--no-live", action="store_true", help="no live table (plain log lines)")

    win = sub.add_parser(
        "windows",
        help="list the curtailment windows a rule finds in one region of a trace",
        description="Read a trace (wide, long or Electricity Maps CSV) and list the windows in which a "
        "site in REGION would train: intensity below a fixed threshold (default 100 gCO2/kWh) or below "
        "a percentile of the region's own trace. Prints each window (UTC), the share of the trace in "
        "window and the mean intensity in and out of windows; optionally plots them to a PNG.",
    )
    _add_trace_argument(win)
    win.add_argument("--region", required=True, help="the region (column or zone id) to examine")
    rule = win.add_mutually_exclusive_group()
    rule.add_argument(
        "--threshold", type=float, metavar="G", help="train while intensity < G gCO2/kWh (default 100)"
    )
    rule.add_argument(
        "--percentile",
        type=float,
        metavar="P",
        help="train while intensity < the P-th percentile (0-100] of the region's whole trace",
    )
    win.add_argument(
        "--period-h",
        type=float,
        metavar="H",
        help="with --percentile: a rolling percentile over the last H hours (only the past, as a live site)",
    )
    _add_trace_options(win)
    win.add_argument(
        "--min-window-s", type=float, default=0.0, metavar="S", help="drop windows shorter than S seconds"
    )
    win.add_argument("--plot", metavar="PNG", help="also write a plot of intensity and windows to PNG")
    win.add_argument("--json", action="store_true", help="print the report as one JSON object")

    sim = sub.add_parser(
        "simulate",
        help="run sites' window policies against a trace without training: energy, emissions, baselines",
        description="Simulate one site per region under a policy until the swarm has done --work "
        "site-hours of training (or the trace ends), and report site-hours, hours with 0/1/2/3+ sites "
        "training, energy, emissions, the share of energy in window, and ratios against each region's "
        "single-site continuous baseline, the threshold ideal and perfect foresight, all at equal work. "
        "Policies: greenswarm (the node's), curtail-llm (the anchor's controller), ideal, deadline "
        "(cleanest hours before --deadline, planned with --forecast), foresight, or a policy YAML "
        "file with scheduler/energy/provisioning sections (see examples/policies/).",
        epilog="example:\n  greenswarm simulate --trace mci.csv --regions CAISO_NORTH,SPP_TX,NEM_SA "
        "--policy curtail-llm --work 17.78 --compare greenswarm,ideal --plot emissions.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_trace_argument(sim)
    sim.add_argument("--regions", required=True, help="comma-separated regions, one site each")
    sim.add_argument(
        "--policy",
        default="greenswarm",
        metavar="NAME|YAML",
        help="greenswarm (default), curtail-llm, ideal, deadline, foresight, or a policy YAML file",
    )
    sim.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a policy field, e.g. --set scheduler.dwell_s=300 (repeatable)",
    )
    sim.add_argument(
        "--threshold", type=float, metavar="G", help="window threshold in gCO2/kWh (policy's: 100)"
    )
    sim.add_argument(
        "--work", type=float, metavar="SITE_HOURS", help="stop when the swarm has trained this much"
    )
    sim.add_argument(
        "--idle-kw",
        type=float,
        metavar="KW",
        help="a site's draw while it waits (default: the policy's -- greenswarm's is the node's 0.468, "
        "since it keeps its model on the GPUs -- and 0 for deadline and foresight, which count the "
        "hours they train; give the node's to model a deadline site that holds its GPUs)",
    )
    sim.add_argument(
        "--calibrate",
        metavar="RUN_DIR",
        help="take the round pause and the power while training and idle from a node run (a site's "
        "run_dir, or a folder of them: each summary.json and rounds.jsonl)",
    )
    sim.add_argument("--start", metavar="ISO", help="start here instead of at the trace's start")
    sim.add_argument("--deadline", type=float, metavar="HOURS", help="deadline policy: finish within HOURS")
    sim.add_argument(
        "--forecast",
        default="noisy",
        help="deadline policy's forecast: noisy (true trace x log-normal error, 30%% a day ahead; default), "
        "oracle, seasonal, persistence, climatology, or file:PATH (forecasts as they were issued: "
        "generated_at,point_time[,region],value or time,value,f1..fN, each used only from its issue time; "
        "read with --tz and "
        "--units, plain or compressed)",
    )
    sim.add_argument(
        "--forecast-error",
        type=float,
        default=0.3,
        metavar="SIGMA",
        help="noisy forecast's log-normal error a day ahead (default 0.3; grows as sqrt(horizon))",
    )
    sim.add_argument("--compare", metavar="POLICIES", help="also simulate these policies (comma-separated)")
    _add_trace_options(sim)
    sim.add_argument("--plot", metavar="PNG", help="write cumulative emissions against the yardsticks to PNG")
    sim.add_argument("--json", action="store_true", help="print the report as one JSON object")

    exp = sub.add_parser(
        "export",
        help="write a site's global model as a Hugging Face model directory",
        description="Write the global model of a site's newest verified checkpoint (or, with --best, of "
        "its best kept checkpoint by the global model's held-out loss) as a Hugging Face model "
        "directory: safetensors weights, config.json and the tokenizer where the site used one, loadable "
        "with AutoModelForCausalLM.from_pretrained(OUT). Works for a site of any number of ranks (FSDP).",
        epilog="example:\n  greenswarm export --run-dir runs/site-a --out models/site-a\n"
        "  greenswarm node --config site.yaml --set model.init_from=models/site-a   # continue from it",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    exp.add_argument("--run-dir", required=True, metavar="DIR", help="the site's node.run_dir")
    exp.add_argument("--out", required=True, metavar="OUT", help="the model directory to write")
    exp.add_argument(
        "--best", action="store_true", help="the best kept checkpoint by held-out loss (eval.keep_best)"
    )
    exp.add_argument("--force", action="store_true", help="replace OUT if it exists and is not empty")
    exp.add_argument("--json", action="store_true", help="print what was written as one JSON object")

    report = sub.add_parser(
        "report",
        help="one static HTML page of runs: loss, states, rounds, emissions against baselines, totals",
        description="Read sites' run directories (summary.json, history.jsonl, rounds.jsonl) and write one "
        "self-contained HTML file, figures embedded: loss against tokens per site, each site's state over "
        "time on its region's intensity and threshold, rounds and their members, cumulative emissions "
        "against continuous training at equal work, and the totals. A directory holding sites' run "
        "directories (a demo's --workdir) counts as all of them; a missing file is said in the page.",
        epilog="example:\n  greenswarm report runs/site-a runs/site-b --out report.html\n"
        "  greenswarm report /tmp/demo --out demo.html   # every site of a demo's work directory",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="a site's node.run_dir, or a folder of them"
    )
    report.add_argument(
        "--out", default="report.html", metavar="HTML", help="the page to write (default: report.html)"
    )
    report.add_argument("--json", action="store_true", help="print where it wrote and what it holds as JSON")

    rep = sub.add_parser(
        "reproduce",
        help="account the curtail-llm anchor's own logged run with greenswarm's ledger",
        description="Read the anchor's event log (and the per-client loss logs beside it), turn it into "
        "when each client was powered and when it trained, account energy and emissions on the trace, "
        "and compare with the paper's published figures.",
        epilog="example:\n  greenswarm reproduce "
        "--events ../shared/data/reference/curtail-llm/exp1_events.csv "
        "--trace ../shared/data/traces/curtail-llm/mci.csv",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rep.add_argument("--events", required=True, metavar="CSV", help="the anchor's exp*_events.csv")
    rep.add_argument("--trace", required=True, metavar="CSV", help="the trace the run followed (mci.csv)")
    rep.add_argument(
        "--regions", metavar="CLIENT=REGION,...", help="clients' regions (default: from the log)"
    )
    rep.add_argument(
        "--offset-s", type=float, default=0.0, metavar="S", help="trace seconds before the log's elapsed 0"
    )
    rep.add_argument(
        "--gap-s",
        type=float,
        default=60.0,
        metavar="S",
        help="a loss-log pause longer than S is not training",
    )
    _add_trace_options(rep, interpolate="linear")

    sw = sub.add_parser(
        "swarm",
        help="admission: create the swarm's authority key, issue membership certificates",
        description="The swarm's authority signs a membership certificate for each admitted site, "
        "binding its name and region to its libp2p peer id (the one its identity file proves) until "
        "an expiry. Keep the authority key private (mode 0600); give sites the .pub file.",
        epilog="example:\n  greenswarm swarm init --key authority.key\n"
        "  greenswarm swarm id --identity site.key            # on the site: its peer id\n"
        "  greenswarm swarm admit --key authority.key --site caiso-north --region CAISO_NORTH "
        "--peer-id 12D3KooW... --expires 90d --out caiso-north.cert\n"
        "  greenswarm swarm check --authority authority.key.pub caiso-north.cert",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    swsub = sw.add_subparsers(dest="swarm_command", metavar="ACTION", required=True)
    init = swsub.add_parser("init", help="create the authority key (KEY, 0600) and its public half (KEY.pub)")
    init.add_argument("--key", required=True, metavar="FILE", help="where to write the authority key")
    admit = swsub.add_parser("admit", help="issue a membership certificate for one site")
    admit.add_argument("--key", required=True, metavar="FILE", help="the authority key")
    admit.add_argument("--swarm", default="greenswarm", help="swarm name (default: greenswarm)")
    admit.add_argument("--site", required=True, help="the site's name (its config's name)")
    admit.add_argument("--region", required=True, help="the site's grid region (its config's region)")
    admit.add_argument("--peer-id", required=True, metavar="ID", help="the site's libp2p peer id")
    admit.add_argument(
        "--expires", default="90d", metavar="WHEN", help="a duration (90d, 12h) or an ISO date (default 90d)"
    )
    admit.add_argument("--out", required=True, metavar="FILE", help="where to write the certificate (0600)")
    admit.add_argument(
        "--max-tokens-per-s",
        type=float,
        metavar="N",
        help="the most tokens a second this site may claim in a round: a larger claim counts as N x the "
        "round's interval (default: only the swarm's averaging.max_tokens_per_s)",
    )
    ident = swsub.add_parser(
        "id", help="print a site's peer id (what the operator admits), creating its identity if missing"
    )
    ident.add_argument("--identity", required=True, metavar="FILE", help="the site's swarm.identity file")
    revoke = swsub.add_parser(
        "revoke",
        help="add a member to the swarm's revocation list (signed by the authority), and store it on the DHT",
        description="Adds each --peer-id (all of its certificates) and --cert (that one) to the revocation "
        "list at --out (a new one if there is none), signs it as the next list, and, given "
        "--initial-peers, stores it on the swarm's DHT: every running member refuses the revoked from then "
        "on. Give the file to sites that start later (swarm.revocations) and to the bootstrap "
        "(--revocations).",
    )
    revoke.add_argument("--key", required=True, metavar="FILE", help="the authority key")
    revoke.add_argument("--swarm", default="greenswarm", help="swarm name (default: greenswarm)")
    revoke.add_argument("--peer-id", action="append", metavar="ID", help="revoke this peer (repeatable)")
    revoke.add_argument(
        "--cert", action="append", metavar="FILE", help="revoke this certificate (repeatable)"
    )
    revoke.add_argument("--reason", help="why (kept in the list, shown in every refusal)")
    revoke.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="the revocation list file (read if it exists, then rewritten)",
    )
    revoke.add_argument(
        "--initial-peers", nargs="+", metavar="MADDR", help="store the list on this swarm's DHT too"
    )
    check = swsub.add_parser("check", help="verify a certificate against the authority's public key")
    check.add_argument("certificate", metavar="CERT")
    check.add_argument("--authority", required=True, metavar="FILE", help="the authority's .pub (or key)")
    check.add_argument("--swarm", help="also require this swarm name")
    check.add_argument("--peer-id", metavar="ID", help="also require this peer id")
    for action in (init, admit, ident, revoke, check):
        action.add_argument("--json", action="store_true", help="print the result as JSON")
    rep.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return parser


def _add_trace_options(parser: argparse.ArgumentParser, interpolate: str = "hold") -> None:
    """How to read a trace file; the same flags on every command that reads one."""
    parser.add_argument("--tz", metavar="TZ", help="IANA timezone of naive timestamps, e.g. Europe/Berlin")
    parser.add_argument(
        "--units", default="g/kWh", help="units of the file's values: g/kWh (default), kg/kWh, lbs/MWh"
    )
    parser.add_argument(
        "--variant", default="direct", help="Electricity Maps column: direct (default) or lca (life cycle)"
    )
    parser.add_argument(
        "--interpolate",
        choices=("hold", "linear"),
        default=interpolate,
        help="read intensity between samples as steps (hold: what a live site sees) or linearly onto a "
        f"--grid grid (linear: the curtail-llm anchor's convention); default {interpolate}",
    )
    parser.add_argument(
        "--grid", type=float, default=60.0, metavar="SECONDS", help="grid step for --interpolate linear (60)"
    )


def _add_trace_argument(parser: argparse.ArgumentParser) -> None:
    """``--trace`` and ``--signal``, repeatable, as ``windows`` and ``simulate`` take them (see
    :func:`_trace_arg`)."""
    parser.add_argument(
        "--trace",
        metavar="CSV",
        action="append",
        default=[],
        help="trace file (CSV, or CSV compressed with gzip, xz or bzip2), a directory of them, or builtin / "
        "builtin:<name>; repeat it (or give a directory) to merge one file per zone into one trace",
    )
    parser.add_argument(
        "--signal",
        metavar="KIND:AREA",
        action="append",
        default=[],
        help="read a zone's history from a live API instead of a file: electricitymaps:ZONE (token in "
        "$ELECTRICITYMAPS_TOKEN or --token-env) or watttime:REGION (login from $WATTTIME_USER and "
        "$WATTTIME_PASSWORD); repeatable, merged with --trace",
    )
    parser.add_argument(
        "--signal-url", metavar="URL", help="with --signal: the API's base URL (default: public)"
    )
    parser.add_argument("--token-env", metavar="NAME", help="with --signal: the variable holding the token")
    parser.add_argument(
        "--since", metavar="ISO", help="with --signal: history from here (default: a day ago)"
    )
    parser.add_argument("--until", metavar="ISO", help="with --signal: history up to here (default: now)")


def _trace_arg(args: argparse.Namespace) -> str | list[str | Trace]:
    """``--trace`` as given (one spec, or several files to merge) and each ``--signal``'s history."""
    if not args.trace and not args.signal:
        raise ConfigError("give a trace file, or --signal KIND:AREA to read one from an API", where="--trace")
    if not args.signal:
        return args.trace[0] if len(args.trace) == 1 else list(args.trace)
    from greenswarm.signals.sources import history_trace

    until = parse_instant(args.until) if args.until else time.time()
    since = parse_instant(args.since) if args.since else until - 86400.0
    fetched = [
        history_trace(
            spec, since=since, until=until, base_url=args.signal_url, token_env=args.token_env,
            variant=args.variant,
        )
        for spec in args.signal
    ]  # fmt: skip
    return [*args.trace, *fetched]


def _trace_options(args: argparse.Namespace) -> dict:
    return {
        "tz": args.tz,
        "units": args.units,
        "variant": args.variant,
        "interpolate": args.interpolate,
        "grid_s": args.grid,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from greenswarm.procs import (
        interrupt_on_termination,
        reap_children,
        settle_stops,
        setup_logging,
        stacks_on_request,
    )

    setup_logging(args.verbose)
    stacks_on_request()
    interrupt_on_termination()
    try:
        return _dispatch(args)
    except GreenswarmError as e:
        print(f"greenswarm {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`greenswarm windows ... | head`): stop quietly
        _silence_stdout()
        return 141  # what a shell reports for a command ended by SIGPIPE
    finally:
        reap_children()  # whatever a command started (a DHT process, p2pd, site nodes) ends with it
        if argv is None:  # the program itself, not a caller in its own process: its status is decided,
            settle_stops()  # and a stop during the interpreter's exit must not turn it into -15


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush of a closed pipe raises nothing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "bootstrap":
        from greenswarm.bootstrap.peer import BootstrapConfig, serve
        from greenswarm.configuration import config_from_dict

        try:
            cfg = config_from_dict(
                BootstrapConfig,
                {
                    "identity": args.identity,
                    "listen": args.listen,
                    "announce": args.announce,
                    "swarm": args.swarm,
                    "initial_peers": args.initial_peers,
                    "relay": not args.no_relay,
                    "authority": args.authority,
                    "revocations": args.revocations,
                    "relay_port": args.relay_port,
                    "relay_data_gib": args.relay_data_gib,
                    "relay_hours": args.relay_hours,
                    "metrics_port": args.metrics_port,
                    "metrics_host": args.metrics_host,
                },
                source="arguments",
            )
        except ConfigError as e:  # every field is a flag here: name the flag the user typed
            flag = f"--{e.field.replace('_', '-')}" if e.field else None
            raise ConfigError(e.message, field=flag) from None
        return serve(cfg, as_json=args.json)
    if args.command == "node":
        from greenswarm.node.runner import run_node

        return run_node(args.config, args.initial_peers, args.overrides, args.run_dir)
    if args.command == "progress":
        from greenswarm.network import check_peers
        from greenswarm.node.progress_view import show_progress

        peers = check_peers(args.initial_peers, "--initial-peers")
        if args.revocations and not args.authority:
            raise ConfigError("a revocation list needs --authority to be checked", field="--revocations")
        return show_progress(
            peers,
            args.swarm,
            as_json=args.json,
            watch=args.watch,
            authority=args.authority,
            revocations=args.revocations,
            shards=args.shards,
        )
    if args.command == "demo":
        from greenswarm.demo import DemoOptions, run_demo

        return run_demo(
            DemoOptions(
                trace=args.trace,
                regions=args.regions,
                threshold=args.threshold,
                minutes=args.minutes,
                hours=args.hours,
                sync_minutes=args.sync_minutes,
                seed=args.seed,
                overrides=args.overrides,
                workdir=args.workdir,
                as_json=args.json,
                live=not args.no_live,
            )
        )
    if args.command == "windows":
        from greenswarm.scheduler.windows_report import run_windows

        return run_windows(
            _trace_arg(args),
            args.region,
            threshold=args.threshold,
            percentile=args.percentile,
            period_h=args.period_h,
            tz=args.tz,
            units=args.units,
            variant=args.variant,
            min_window_s=args.min_window_s,
            plot=args.plot,
            as_json=args.json,
            interpolate=args.interpolate,
            grid_s=args.grid,
        )
    if args.command == "simulate":
        from greenswarm.simulation.report import run_simulate

        return run_simulate(
            _trace_arg(args),
            args.regions,
            policy=args.policy,
            overrides=args.overrides,
            threshold=args.threshold,
            work=args.work,
            start=args.start,
            deadline=args.deadline,
            forecast=args.forecast,
            forecast_error=args.forecast_error,
            idle_kw=args.idle_kw,
            calibrate=args.calibrate,
            compare=args.compare,
            trace_options=_trace_options(args),
            plot=args.plot,
            as_json=args.json,
        )
    if args.command == "swarm" and args.swarm_command == "revoke":
        if args.initial_peers:
            from greenswarm.network import check_peers as check_revoke_peers

            check_revoke_peers(args.initial_peers, "--initial-peers")
        from greenswarm.node.revocations import run_revoke

        return run_revoke(args)
    if args.command == "swarm":
        from greenswarm.security.admin import run_swarm_command

        return run_swarm_command(args)
    if args.command == "export":
        from greenswarm.node.export import export_run, print_export

        print_export(export_run(args.run_dir, args.out, best=args.best, force=args.force), args.json)
        return 0
    if args.command == "report":
        from greenswarm.report.build import run_report

        return run_report(args.run_dirs, args.out, as_json=args.json)
    if args.command == "reproduce":
        from greenswarm.simulation.reproduce import run_reproduce

        return run_reproduce(
            args.events,
            args.trace,
            regions=args.regions,
            offset_s=args.offset_s,
            gap_s=args.gap_s,
            trace_options=_trace_options(args),
            as_json=args.json,
        )
    raise AssertionError(args.command)
