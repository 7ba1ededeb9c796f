"""``greenswarm report``: the run report from sites' run directories, and the history the node writes
for it.

The run directories here are made in-process in well under a second: the node's own :class:`History`
and :class:`RoundLog` write them from a scripted run over a small trace, with the real energy ledger,
so the report reads what a node writes. One test opens the page in a real headless Chromium
(Debian's, driven by playwright): it must load, show every section and log no error. Without
Chromium that test skips, unless ``GREENSWARM_REQUIRE_BROWSER=1`` (CI), where it fails.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from greenswarm import demo
from greenswarm.cli import main
from greenswarm.node.history import History, read_history, threshold_at
from greenswarm.node.round_log import RoundEntry, RoundLog
from greenswarm.report import figures
from greenswarm.report.build import write_report
from greenswarm.report.figures import emission_curves, round_marks
from greenswarm.report.page import MAX_ROUND_ROWS, SECTIONS
from greenswarm.report.runs import read_runs
from greenswarm.scheduler.config import EnergyConfig, SchedulerConfig
from greenswarm.scheduler.energy import EnergyLedger, PowerModel, baseline_emissions_g
from greenswarm.scheduler.policy import PercentilePolicy, ThresholdPolicy, WindowSchedule
from greenswarm.scheduler.state import SiteState
from greenswarm.traces import load_trace
from tests.conftest import write_trace

pytestmark = pytest.mark.observability

SECTION_IDS = [s for s, _ in SECTIONS]
START = "2026-01-01T00:00:00Z"
STEP_S = 600.0  # one scripted loop turn: ten minutes of clock time
SYNC_S = 1800.0
CHROMIUM = os.environ.get("GREENSWARM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"

#: two regions, 48 ten-minute samples: A is clean for the first half, B for the middle half
TRACE = {
    "A": [40.0] * 24 + [400.0] * 24,
    "B": [500.0] * 12 + [30.0 + i for i in range(24)] + [500.0] * 12,
}


@dataclass
class FakeClock:
    t: float
    speedup: float = 60.0

    def now(self) -> float:
        return self.t


def _trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.csv"
    if not path.exists():
        write_trace(path, TRACE, start=START, step_s=int(STEP_S))
    return path


def make_run(
    tmp_path: Path,
    name: str,
    region: str,
    *,
    partners: dict[int, list[str]] | None = None,
    threshold: float = 100.0,
    under: str = "runs",
) -> Path:
    """A site's run directory as a node leaves it, ``tmp_path/under/name``: a scripted run over the
    trace (train while intensity < ``threshold``, a round every 30 minutes: federated with
    ``partners[n]`` at the n-th boundary, else alone), its history and round log written by the node's
    own writers, and its summary from the real ledger."""
    trace_path = _trace(tmp_path)
    trace = load_trace(str(trace_path))
    run_dir = tmp_path / under / name
    scheduler = SchedulerConfig(trace=str(trace_path), threshold=threshold)
    schedule = WindowSchedule(trace, region, scheduler.window_policy())
    clock = FakeClock(trace.start)
    ledger = EnergyLedger(trace, region, PowerModel(2.0, 0.5), start=trace.start)
    stats = SimpleNamespace(local_steps=0, tokens=0, loss=None, eval_loss=None)
    node = SimpleNamespace(
        cfg=SimpleNamespace(
            name=name,
            region=region,
            scheduler=scheduler,
            energy=EnergyConfig(train_kw=2.0, idle_kw=0.5),
            averaging=SimpleNamespace(sync_interval_s=SYNC_S),
        ),
        clock=clock,
        state=SiteState.IDLE,
        stats=stats,
        ledger=ledger,
        schedule=schedule,
        global_state=SimpleNamespace(outer_round=0),
    )
    history = History(run_dir, every_s=0.0)  # every loop turn: the test's clock jumps ten minutes a turn
    rounds = RoundLog(run_dir, started=0.0)
    counts = {"federated_rounds": 0, "solo_rounds": 0, "failed_rounds": 0, "catch_ups": 0, "resyncs": 0}
    partners = partners or {}
    history.maybe_write(node, force=True)
    while clock.t < trace.end - STEP_S:
        clock.t += STEP_S
        ledger.advance(clock.t, node.state)
        node.state = SiteState.SOLO if schedule.in_window(clock.t) else SiteState.IDLE
        if node.state is SiteState.SOLO:
            stats.local_steps += 10
            stats.tokens += 10 * 4096
            stats.loss = 5.5 * 0.97 ** (stats.local_steps / 10)
            slot = int(clock.t // SYNC_S)
            if clock.t % SYNC_S == 0:
                node.global_state.outer_round += 1
                group = partners.get(int((clock.t - trace.start) // SYNC_S))
                if group:
                    node.state = SiteState.FEDERATED
                    counts["federated_rounds"] += 1
                else:
                    counts["solo_rounds"] += 1
                entry = RoundEntry(
                    slot=slot,
                    action="apply" if group else "solo",
                    outer_round=node.global_state.outer_round,
                    lineage=f"l{slot}",
                    digest="d",
                    members=sorted({name, *(group or [])}),
                    wire="bf16" if group else "",
                    round_s=0.5 if group else None,
                )
                rounds.write(entry)
                stats.eval_loss = stats.loss + 0.1
                history.maybe_write(node, force=True)
        history.maybe_write(node)
    summary = {
        "site": name,
        "region": region,
        "outer_round": node.global_state.outer_round,
        **counts,
        "local_steps": stats.local_steps,
        "tokens": stats.tokens,
        "loss": stats.loss,
        "first_loss": 5.5,
        "energy_kwh": ledger.energy_kwh,
        "emissions_g": ledger.emissions_g,
        "seconds_by_state": dict(ledger.seconds),
        "kwh_by_state": dict(ledger.kwh),
        "emissions_g_by_state": dict(ledger.grams),
        "sync_interval_s": SYNC_S,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def two_sites(tmp_path: Path) -> list[Path]:
    """Sites a and b: a clean early, b in the middle; they overlap, and average, at the 6th and 7th
    boundaries (3 and 3.5 hours in)."""
    together = {6: ["a", "b"], 7: ["a", "b"]}
    return [make_run(tmp_path, "a", "A", partners=together), make_run(tmp_path, "b", "B", partners=together)]


def sections(html: str) -> dict[str, str]:
    """Each section's HTML by id."""
    found = dict(re.findall(r'<section id="([a-z]+)">(.*?)</section>', html, flags=re.S))
    assert list(found) == SECTION_IDS
    return found


# ---------------------------------------------------------------- the history the node writes


def test_history_writes_a_start_line_then_points_on_state_changes_events_and_its_interval(
    tmp_path: Path,
) -> None:
    run_dir = make_run(tmp_path, "a", "A")
    lines = read_history(run_dir / "history.jsonl")
    assert [x["kind"] for x in lines[:2]] == ["start", "point"]
    start = lines[0]
    assert start["trace"] == str(_trace(tmp_path).resolve())
    assert (start["threshold"], start["sync_interval_s"], start["train_kw"]) == (100.0, SYNC_S, 2.0)
    points = lines[1:]
    states = [p["state"] for p in points]
    assert "SOLO" in states and states[-1] == "IDLE"
    # the clock only moves forward, tokens never fall, and the ledger's figures are the summary's
    assert [p["clock"] for p in points] == sorted(p["clock"] for p in points)
    assert [p["tokens"] for p in points] == sorted(p["tokens"] for p in points)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert points[-1]["emissions_g"] == pytest.approx(summary["emissions_g"])
    assert points[-1]["trained_s"] == pytest.approx(summary["seconds_by_state"]["SOLO"])
    assert {p["intensity"] for p in points} <= set(TRACE["A"])


def test_history_keeps_quiet_between_its_interval_unless_the_state_changes_or_an_event_comes(
    tmp_path: Path,
) -> None:
    trace = load_trace(str(_trace(tmp_path)))
    node = SimpleNamespace(
        cfg=SimpleNamespace(
            name="a",
            region="A",
            scheduler=SchedulerConfig(trace="builtin"),
            energy=EnergyConfig(),
            averaging=SimpleNamespace(sync_interval_s=SYNC_S),
        ),
        clock=FakeClock(trace.start),
        state=SiteState.IDLE,
        stats=SimpleNamespace(local_steps=0, tokens=0, loss=float("nan"), eval_loss=None),
        ledger=EnergyLedger(trace, "A", PowerModel(2.0, 0.5), start=trace.start),
        schedule=SimpleNamespace(),  # a deadline plan: no window rule, so no threshold
    )
    history = History(tmp_path, every_s=3600.0)
    history.maybe_write(node)  # the first: start line and a point
    history.maybe_write(node)  # nothing new within the interval
    history.maybe_write(node, force=True)  # an event
    node.state = SiteState.SOLO
    history.maybe_write(node)  # a state change
    lines = read_history(tmp_path / "history.jsonl")
    assert [x["kind"] for x in lines] == ["start", "point", "point", "point"]
    assert [x["state"] for x in lines[1:]] == ["IDLE", "IDLE", "SOLO"]
    assert lines[1]["loss"] is None and lines[1]["threshold"] is None  # NaN is no JSON; no rule, no line
    assert lines[1]["outer_round"] == 0  # (a node that has not started has no global state yet)


def test_threshold_at_follows_each_window_rule(tmp_path: Path) -> None:
    trace = load_trace(str(_trace(tmp_path)))
    assert threshold_at(ThresholdPolicy(80.0), trace, "A", trace.start) == 80.0
    assert threshold_at(SchedulerConfig(threshold=90.0).window_policy(), trace, "A", trace.start) == 90.0
    whole = threshold_at(PercentilePolicy(50.0), trace, "A", trace.start)
    assert whole == pytest.approx(220.0)  # the median of 24 x 40 and 24 x 400
    rolling = PercentilePolicy(50.0, period_s=4 * STEP_S)
    assert threshold_at(rolling, trace, "A", trace.start + 10 * STEP_S) == 40.0  # only the past counts
    assert threshold_at(rolling, trace, "A", trace.start - 1.0) is None  # nothing seen yet
    assert threshold_at(None, trace, "A", trace.start) is None


# ---------------------------------------------------------------- the page


def test_report_of_two_sites_shows_every_section_with_figures_and_the_totals(tmp_path: Path) -> None:
    dirs = two_sites(tmp_path)
    written = write_report(dirs, tmp_path / "out" / "report.html")
    html = Path(written["out"]).read_text()
    found = sections(html)
    assert written["sections"] == dict.fromkeys(SECTION_IDS, "shown")
    for figure in ("loss", "states", "rounds", "emissions"):
        assert re.search(r'<img src="data:image/png;base64,[A-Za-z0-9+/=]{1000,}"', found[figure]), figure
    # self-contained: nothing to fetch, nothing to run
    assert not re.search(r"(src|href)=\"(https?:|//)", html) and "<script" not in html and "<link" not in html
    # the rounds: both sites' averaged rounds in one row each, with the group
    assert found["rounds"].count("a, b") == 2
    # the totals: each site, and the sum; the equal-work baseline is the ledger's own integral
    trace = load_trace(str(_trace(tmp_path)))
    rows = {row["site"]: row for row in written["totals"]}
    assert set(rows) == {"a", "b", "total"}
    for name, region in (("a", "A"), ("b", "B")):
        summary = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
        trained = summary["seconds_by_state"]["SOLO"] + summary["seconds_by_state"]["FEDERATED"]
        expected = baseline_emissions_g(trace, region, trace.start, trace.start + trained, 2.0)
        assert rows[name]["at_once_g"] == pytest.approx(expected)
        assert rows[name]["tokens"] == summary["tokens"]
        assert rows[name]["federated_rounds"] == 2
    assert rows["total"]["emissions_g"] == pytest.approx(rows["a"]["emissions_g"] + rows["b"]["emissions_g"])
    # b trained in the middle of the trace: at once from the start, on dirty power, it would emit more
    assert rows["b"]["training_vs_at_once"] < 0.2
    assert f"{rows['total']['tokens']:,}" in found["totals"]


def test_a_folder_of_run_directories_counts_as_all_of_them(tmp_path: Path) -> None:
    two_sites(tmp_path)
    written = write_report([tmp_path / "runs"], tmp_path / "report.html")
    assert [s["site"] for s in written["sites"]] == ["a", "b"]


def test_two_runs_of_one_site_are_told_apart_by_their_directories_and_both_drawn_and_counted(
    tmp_path: Path,
) -> None:
    # site a twice: a first run that trained all day alone, and a second, with b, that trained in A's
    # clean half and averaged with b at the 6th boundary. Different emissions, different rounds.
    first = make_run(tmp_path, "a", "A", threshold=450.0, under="first")
    together = {6: ["a", "b"]}
    b = make_run(tmp_path, "b", "B", partners=together)
    second = make_run(tmp_path, "a", "A", partners=together, under="again")
    dirs = [first, b, second]
    written = write_report(dirs, tmp_path / "report.html")
    assert [s["site"] for s in written["sites"]] == ["a (first/a)", "b", "a (again/a)"]
    assert written["sections"] == dict.fromkeys(SECTION_IDS, "shown")
    summaries = [json.loads((d / "summary.json").read_text()) for d in dirs]
    assert summaries[0]["emissions_g"] != pytest.approx(summaries[2]["emissions_g"])
    runs = read_runs(dirs)
    # the emissions figure: one curve per run, each its own, and the swarm's sums count all three
    curves = emission_curves(runs)
    assert curves is not None and [i for i, _ in curves.drawn] == [0, 1, 2]
    for actual, summary in zip(curves.actual, summaries, strict=True):
        assert actual[-1] == pytest.approx(summary["emissions_g"])
    assert curves.total[-1] == pytest.approx(sum(s["emissions_g"] for s in summaries))
    assert len(curves.known_baselines) == 3
    assert curves.known_baselines[0][-1] != pytest.approx(curves.known_baselines[2][-1])
    rows = {row["site"]: row for row in written["totals"]}
    assert rows["total"]["emissions_g"] == pytest.approx(sum(s["emissions_g"] for s in summaries))
    # the rounds figure: each run's own marks on its own row (first run on top), and the group line
    # joins b to the run of a that averaged with it, not to the first one that bears the same name
    marks = round_marks(runs)
    assert marks is not None and marks.rows == [2, 1, 0]
    for run, row in zip(runs, marks.rows, strict=True):
        drawn = sorted(t for (r, _), ts in marks.marks.items() if r == row for t in ts)
        assert drawn == sorted(float(e["slot"]) * SYNC_S for e in run.rounds)
    assert len(runs[0].rounds) != len(runs[2].rounds)
    assert (2, "apply") not in marks.marks and len(marks.marks[(0, "apply")]) == 1
    boundary = marks.marks[(0, "apply")][0]
    assert marks.groups == [(boundary, 0, 1)]


def test_runs_of_one_site_under_folders_of_one_name_get_labels_that_differ(tmp_path: Path) -> None:
    one = make_run(tmp_path, "a", "A", under="exp1/runs")
    two = make_run(tmp_path, "a", "A", threshold=450.0, under="exp2/runs")
    written = write_report([one, two], tmp_path / "report.html")
    assert [s["site"] for s in written["sites"]] == ["a (exp1/runs/a)", "a (exp2/runs/a)"]


def _many_rounds(tmp_path: Path, slots: int) -> list[Path]:
    """Sites a and b with ``slots`` rounds each and nothing else (no history): every third averaged
    together, the rest alone; as a production run of weeks leaves its round logs."""
    first = int(load_trace(str(_trace(tmp_path))).start // SYNC_S)
    dirs = []
    for name in ("a", "b"):
        run_dir = tmp_path / "runs" / name
        log = RoundLog(run_dir, started=0.0)
        for n in range(slots):
            together = n % 3 == 0
            log.write(
                RoundEntry(
                    slot=first + n,
                    action="apply" if together else "solo",
                    outer_round=n + 1,
                    lineage=f"l{n}",
                    digest="d",
                    members=["a", "b"] if together else [name],
                    wire="bf16" if together else "",
                )
            )
        summary = {"site": name, "region": "A", "sync_interval_s": SYNC_S}
        (run_dir / "summary.json").write_text(json.dumps(summary))
        dirs.append(run_dir)
    return dirs


def test_the_rounds_table_of_a_long_run_shows_the_newest_slots_and_says_how_many_are_left_out(
    tmp_path: Path,
) -> None:
    slots = 2500
    dirs = _many_rounds(tmp_path, slots)
    written = write_report(dirs, tmp_path / "report.html")
    assert written["sections"]["rounds"] == "shown"
    found = sections(Path(written["out"]).read_text())["rounds"]
    table = found[found.index("<tbody>") :]
    shown = re.findall(r'<tr><td>[^<]*</td><td class="num">(\d+)</td>', table)
    first = int(load_trace(str(_trace(tmp_path))).start // SYNC_S)
    assert [int(s) for s in shown] == list(range(first + slots - MAX_ROUND_ROWS, first + slots))
    left_out = re.search(r'<p class="note" id="rounds-left-out">([^<]*)</p>', found)
    assert left_out is not None
    assert (
        f"newest {MAX_ROUND_ROWS:,}" in left_out[1] and f"{slots - MAX_ROUND_ROWS:,} earlier" in left_out[1]
    )
    assert "rounds.jsonl" in left_out[1] and "figure above" in left_out[1]
    # the figure still covers every round of both sites, and every averaged group
    assert re.search(r'<img src="data:image/png;base64,', found)
    marks = round_marks(read_runs(dirs))
    assert marks is not None
    assert sum(len(ts) for ts in marks.marks.values()) == 2 * slots
    assert len(marks.groups) == len(range(0, slots, 3))


def test_a_short_run_has_every_round_slot_in_the_table_and_no_note_of_any_left_out(tmp_path: Path) -> None:
    found = sections(Path(write_report(two_sites(tmp_path), tmp_path / "r.html")["out"]).read_text())
    assert "rounds-left-out" not in found["rounds"] and "left out" not in found["rounds"]


def test_missing_files_are_said_in_the_page_and_in_one_log_line_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    full = make_run(tmp_path, "a", "A")
    rounds_only = tmp_path / "runs" / "c"
    rounds_only.mkdir()
    shutil.copy(full / "rounds.jsonl", rounds_only / "rounds.jsonl")
    history_only = tmp_path / "runs" / "d"
    history_only.mkdir()
    text = (full / "history.jsonl").read_text().replace('"site":"a"', '"site":"d"')
    (history_only / "history.jsonl").write_text(text + '{"kind":"point","clock":')  # a torn last line
    garbled = tmp_path / "runs" / "e"
    garbled.mkdir()
    (garbled / "summary.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="greenswarm.report"):
        written = write_report([full, rounds_only, history_only, garbled], tmp_path / "report.html")
    notes = {s["site"]: s["notes"] for s in written["sites"]}
    assert notes["a"] == []
    assert any("no summary.json" in n for n in notes["c"]) and any(
        "no history.jsonl" in n for n in notes["c"]
    )
    assert any("no rounds.jsonl" in n for n in notes["d"]) and any("no summary.json" in n for n in notes["d"])
    assert any("not valid JSON" in n for n in notes["e"])
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 3 and all(any(w.startswith(f"{s} (") for w in warned) for s in "cde"), warned
    html = Path(written["out"]).read_text()
    assert "no history.jsonl" in sections(html)["sites"]
    # d's totals come from its history, which the node writes as it goes
    d = next(row for row in written["totals"] if row["site"] == "d")
    a = next(row for row in written["totals"] if row["site"] == "a")
    assert d["tokens"] == a["tokens"] and d["emissions_g"] == pytest.approx(a["emissions_g"])


def test_runs_without_a_history_still_give_rounds_and_totals_and_say_what_is_missing(tmp_path: Path) -> None:
    run = make_run(tmp_path, "a", "A")
    (run / "history.jsonl").unlink()
    written = write_report([run], tmp_path / "report.html")
    assert written["sections"]["rounds"] == "shown" and written["sections"]["totals"] == "shown"
    for figure in ("loss", "states", "emissions"):
        assert written["sections"][figure].startswith("missing: ")
        assert 'class="missing"' in sections(Path(written["out"]).read_text())[figure]


def test_a_trace_that_cannot_be_read_here_draws_the_sites_own_samples(tmp_path: Path) -> None:
    run = make_run(tmp_path, "a", "A")
    _trace(tmp_path).rename(tmp_path / "moved.csv")
    written = write_report([run], tmp_path / "report.html")
    assert written["sections"]["states"] == "shown" and written["sections"]["emissions"] == "shown"
    assert any("cannot be read here" in n for n in written["sites"][0]["notes"])
    assert written["totals"][0]["at_once_g"] is None  # no trace, no baseline: said as "-", not guessed


def test_text_from_a_run_directory_is_escaped(tmp_path: Path) -> None:
    run = make_run(tmp_path, "a", "A")
    summary = json.loads((run / "summary.json").read_text())
    summary["site"] = "<script>alert(1)</script>"
    (run / "summary.json").write_text(json.dumps(summary))
    html = Path(write_report([run], tmp_path / "report.html")["out"]).read_text()
    assert "<script" not in html and "&lt;script&gt;" in html


# ---------------------------------------------------------------- the command


def test_cli_writes_the_report_and_says_where_as_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dirs = two_sites(tmp_path)
    out = tmp_path / "r.html"
    assert main(["report", *map(str, dirs), "--out", str(out), "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert said["out"] == str(out.resolve()) and out.stat().st_size == said["bytes"]
    assert [s["site"] for s in said["sites"]] == ["a", "b"]


@pytest.mark.parametrize("kind", ["empty", "absent", "file"])
def test_a_path_that_is_no_run_directory_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture, kind: str
) -> None:
    path = tmp_path / kind
    if kind == "empty":
        path.mkdir()
    elif kind == "file":
        path.write_text("x")
    assert main(["report", str(path), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"greenswarm report: error: {path}: ") and "\n" not in err
    assert not (tmp_path / "r.html").exists()


# ---------------------------------------------------------------- in the demo


def _boom(*_: Any) -> bytes:
    raise ValueError("Image size of 1100x99999 pixels is too large\nsecond line")


@pytest.mark.parametrize("failure", ["drawing", "no site directory"])
def test_the_demo_says_in_one_line_that_its_report_was_not_written_and_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """A figure that fails to draw (a matplotlib error, not a GreenswarmError) or a site that left no
    run directory: no report, one line on stderr naming where it would have been and why, no exception
    (run_demo then goes on to write report.json and return the run's own exit code)."""
    workdir = tmp_path / "runs"
    make_run(tmp_path, "site-a", "A")
    regions = ["A"]
    if failure == "drawing":
        monkeypatch.setattr(figures, "emissions_figure", _boom)
    else:
        regions.append("B")  # site-b never wrote anything
    assert demo._html_report(workdir, regions) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(workdir / "report.html") in err, err
    if failure == "drawing":
        assert "ValueError: Image size of 1100x99999 pixels is too large" in err
    else:
        assert "ReportError: " in err and "site-b: no such directory" in err
    assert not (workdir / "report.html").exists()


def test_the_demo_writes_its_report_beside_the_sites(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    make_run(tmp_path, "site-a", "A")
    out = demo._html_report(tmp_path / "runs", ["A"])
    assert out == str((tmp_path / "runs" / "report.html").resolve()) and capsys.readouterr().err == ""


# ---------------------------------------------------------------- in a real browser


def _browser() -> Any:
    """playwright's sync API, or a skip (a failure where ``GREENSWARM_REQUIRE_BROWSER=1``)."""
    required = os.environ.get("GREENSWARM_REQUIRE_BROWSER") == "1"
    reason = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as err:
        reason = f"playwright is not installed ({err})"
    if reason is None and not Path(CHROMIUM).is_file():
        reason = f"no Chromium at {CHROMIUM} (apt-get install chromium)"
    if reason is not None:
        if required:
            pytest.fail(f"the browser test is required here but cannot run: {reason}")
        pytest.skip(reason)
    return sync_playwright


def test_the_report_loads_in_headless_chromium_with_every_section_and_no_errors(tmp_path: Path) -> None:
    sync_playwright = _browser()
    out = Path(write_report(two_sites(tmp_path), tmp_path / "report.html")["out"])
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on(
                "console",
                lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None,
            )
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
            page.goto(out.as_uri(), wait_until="load")
            assert page.title() == "greenswarm run report"
            for section_id, heading in SECTIONS:
                section = page.locator(f"#{section_id}")
                section.scroll_into_view_if_needed()
                assert section.is_visible(), section_id
                assert section.locator("h2").inner_text() == heading
            images = page.locator("img")
            assert images.count() == 4
            for i in range(images.count()):
                images.nth(i).scroll_into_view_if_needed()
                width = images.nth(i).evaluate("img => img.complete ? img.naturalWidth : 0")
                assert width > 500, f"image {i} did not decode"
            assert page.locator("#totals tbody tr").count() == 3  # two sites and the total
        finally:
            browser.close()
    assert problems == []
