"""A certified swarm under attack from inside (issue #19), with real processes, one run for every test.

Four admitted sites a, b, c and p train together with ``averaging.aggregate: trimmed-mean``. p is
compromised: in every round it sends -10x its pseudo-gradient while claiming that update's norm
(``poison-flip``: screening lets it through, since it is within the norm bound). Every site's first
served state is forged (``serve-forged@1``). A fifth site, n, whose window opens 60 minutes in,
enters behind the swarm and must catch up. Once n has caught up and each honest site has averaged
three rounds with p, the operator revokes p with ``greenswarm swarm revoke --initial-peers ...``. The
module runs this once; each test reads what it needs:

* the trimmed mean resists one attacker of four: the honest sites' loss falls though p averaged in
  every round;
* a forged state is refused against the lineage's signed records, the server named, and the site
  takes its state from another holder (nobody ever holds a state its lineage's holders did not sign);
* the revoked member is refused within one round: no group takes it after that, every member
  applies the list, and p itself stops, saying it is no longer a member.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from greenswarm.bootstrap.identity import load_or_create_identity
from greenswarm.node.round_log import read_rounds
from greenswarm.security.certificates import create_authority, issue
from tests.conftest import LEARNED_LOSS, Swarm, loss_fell, site_config, wait_until, write_trace

pytestmark = [pytest.mark.swarm, pytest.mark.security, pytest.mark.hardening]

#: a round every 10 wall seconds. It was 5 (SYNC_S 600): a round here takes 2-4.5 s (2 s of matchmaking,
#: the all-reduce, the digests) and a site's catch-up 0.5-1.2 s under CI's load, so a site that fell a
#: step behind (a void round at the revocation) caught up only after the others' next round had begun,
#: every round (docs/testing.md row 49: b averaged none of the 6 rounds after it). A real round interval
#: is minutes; the test keeps its premise -- a round fits in its slot with room for a catch-up -- with
#: as many rounds before the revocation (n joins at 60 min: 3 with p) and after it. The trace held 13
#: rounds; the swarm is stopped once the rounds after the revocation are in, so the last 3 are only run
#: when the revocation itself is slow: beside two busy processes `greenswarm swarm revoke` took 50 s
#: from n's catch-up to the list in force, and the 10 rounds the trace held then left none after it
#: (docs/testing.md row 66). It holds 30 now: the scenario ends on its events (the rounds after the
#: revocation), so the trace only bounds how long a slow machine may take to reach them, and 13 did
#: not: beside two busy processes half the rounds found no group, a averaged its third round with p
#: 9 rounds in, the revocation took 4 more, and p's trace ended (exit 0, not 2) a second before the
#: list reached it (docs/testing.md row 90). A quiet run stops at the same round as before
SPEEDUP, SYNC_S, MINUTES, JOIN_MIN, AFTER = 120.0, 1200.0, 600, 60, 2
WITH_P = 3  # rounds each honest site averages with p before p is revoked
ROUND_WALL_S = SYNC_S / SPEEDUP
HONEST = ("a", "b", "c")
FIRST = (*HONEST, "p")


@dataclass
class Run:
    """What the module's run left: its folder, the sites' logs and exit codes, and when p was revoked."""

    tmp: Path
    logs: dict[str, str]
    codes: dict[str, int]
    revoked_at: float  # wall time the revocation list reached the DHT
    p_peer: str

    def rounds(self, name: str) -> list[dict]:
        return read_rounds(self.tmp / name / "rounds.jsonl")

    def summary(self, name: str) -> dict:
        return json.loads((self.tmp / name / "summary.json").read_text())


@pytest.fixture(autouse=True)
def no_orphan_daemons() -> Iterator[None]:
    """(The module's swarm outlives each test; the run fixture reaps it and checks what it leaves.)"""
    yield


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("hardening")
    swarm = Swarm(tmp)
    try:
        yield _attack(swarm, tmp)
    finally:
        swarm.close()


def _attack(swarm: Swarm, tmp: Path) -> Run:
    authority = tmp / "authority.key"
    create_authority(authority)
    # n's region is dirty for its first JOIN_MIN minutes: it starts with the others, and enters its
    # window (and the swarm) behind them, whatever its start-up took on a busy machine
    steps, late = MINUTES // 5, JOIN_MIN // 5
    trace = write_trace(
        tmp / "trace.csv", {"R": [20.0] * steps, "N": [500.0] * late + [20.0] * (steps - late)}
    )
    peers = swarm.bootstrap(
        "bootstrap", "test", "/ip4/127.0.0.1/tcp/0", "", "--authority", f"{authority}.pub"
    )
    start_file = tmp / "start"
    configs = {}
    for i, name in enumerate((*FIRST, "n")):
        identity = tmp / f"{name}.key"
        region = "N" if name == "n" else "R"
        issue(authority, swarm="test", site=name, region=region, peer_id=load_or_create_identity(identity),
              valid_s=3600, out=tmp / f"{name}.cert")  # fmt: skip
        cfg = site_config(
            name, region, trace, peers, tmp / name, speedup=SPEEDUP, start_file=start_file, sync_s=SYNC_S,
            shard=i, shards=5,
            swarm={"identity": str(identity), "certificate": str(tmp / f"{name}.cert"),
                   "authority": f"{authority}.pub"},
            averaging={"aggregate": "trimmed-mean", "trim": 0.25},
        )  # fmt: skip
        configs[name] = swarm.write_config(name, cfg)
    faults = {name: "serve-forged@1" for name in (*FIRST, "n")}
    faults["p"] = "poison-flip@*,serve-forged@1"
    for name in (*FIRST, "n"):
        swarm.node(name, configs[name], env={"GREENSWARM_FAULTS": faults[name]})
    start_wall = swarm.start_replay([*FIRST, "n"], start_file)

    # JOIN_MIN minutes in, the newcomer enters behind the swarm; it catches up past the forged serves
    join_s = start_wall + JOIN_MIN * 60 / SPEEDUP - time.time()
    wait_until(lambda: "caught up with" in swarm.log("n"), join_s + 60, "the newcomer to catch up")
    # and the operator revokes p once each honest site has averaged WITH_P rounds with it: the rounds
    # before n's window were to hold them, but on a busy machine a site can miss a round or two of them
    # (CI: a's first round formed before p's start-up was done, and a caught up past two more), and the
    # revocation would then cut p off before the attack the first test measures had happened
    # (at the latest with room for the rounds after it, the revocation's own and its void round: if it
    # comes before those WITH_P rounds, the first test says so)
    latest = start_wall + MINUTES * 60 / SPEEDUP - (AFTER + 2) * ROUND_WALL_S
    while time.time() < latest and not all(_applied_with_p(tmp, name) >= WITH_P for name in HONEST):
        time.sleep(0.3)

    # the operator revokes p; the list goes to the swarm's DHT
    p_peer = load_or_create_identity(tmp / "p.key")
    revoked = subprocess.run(
        [sys.executable, "-m", "greenswarm", "swarm", "revoke", "--key", str(authority), "--swarm", "test",
         "--peer-id", p_peer, "--reason", "sent flipped updates", "--out", str(tmp / "revoked.json"),
         "--initial-peers", *peers, "--json"],
        capture_output=True, text=True, timeout=90, cwd=tmp,
    )  # fmt: skip
    assert revoked.returncode == 0, revoked.stderr[-2000:]
    assert json.loads(revoked.stdout)["published"] is True
    revoked_at = time.time()

    # the honest three go on without p, and the newcomer, caught up, with them: once each of the three
    # has applied AFTER rounds since the revocation and n one (however late the catch-up and the
    # revocation came on a busy machine), the operator stops the swarm; the trace is long enough that
    # this happens well before it ends
    def applied_after(name: str) -> int:
        rounds = read_rounds(tmp / name / "rounds.jsonl") if (tmp / name / "rounds.jsonl").exists() else []
        return sum(1 for r in rounds if r["action"] == "apply" and r["wall_time"] > revoked_at)

    def going_on() -> bool:
        return any(applied_after(name) < AFTER for name in HONEST) or applied_after("n") < 1

    end_s = start_wall + MINUTES * 60 / SPEEDUP - time.time()
    deadline = time.monotonic() + max(end_s, 0)
    while time.monotonic() < deadline and going_on():
        time.sleep(0.3)
    codes = {"p": swarm.wait("p", timeout=max(deadline - time.monotonic(), 0) + 90)}
    for name in (*HONEST, "n"):  # a clean stop: the last checkpoint and summary
        os.kill(swarm.procs[name].pid, signal.SIGTERM)
    codes |= {name: swarm.wait(name, timeout=90) for name in (*HONEST, "n")}
    return Run(tmp, {name: swarm.log(name) for name in (*FIRST, "n", "bootstrap")}, codes, revoked_at, p_peer)


def _applied_with_p(tmp: Path, name: str) -> int:
    """How many rounds site ``name`` applied with p in its group, so far."""
    path = tmp / name / "rounds.jsonl"
    rounds = read_rounds(path) if path.exists() else []
    return sum(1 for r in rounds if r["action"] == "apply" and "p" in r["members"])


def test_the_trimmed_mean_resists_one_attacker_of_four(run: Run) -> None:
    """p's flipped update went into round after round with the honest three, and they still learned
    (with the mean, -10x one update of four turns each step around: docs/security.md measures it)."""
    summaries = [run.summary(name) for name in HONEST]
    for name, summary in zip(HONEST, summaries, strict=True):
        assert _applied_with_p(run.tmp, name) >= WITH_P, (name, run.rounds(name))
        assert loss_fell(summary), summary
    assert min(s["loss"] for s in summaries) < LEARNED_LOSS, summaries
    assert "fault injected: poison-flip" in run.logs["p"]


def test_a_forged_state_is_refused_and_another_holder_serves_it(run: Run) -> None:
    refusals = [
        (name, line)
        for name, log in run.logs.items()
        for line in log.splitlines()
        if "refused the state served by" in line
    ]
    assert refusals, "no site saw a forged state"
    # the server is named, with what was wrong with its state: its digest is not the signed one, or
    # (a state served while the swarm stepped on: checked against fresh records, no live member
    # attests its outer step any more) its position. Only the digest was accepted here until the
    # last soak of issue 40 (docs/testing.md row 46): a's forged serve of step 2 reached n after
    # every holder had stepped to 4, and was refused for that, before its digest was compared.
    assert all(
        re.search(
            r"served by \w+ \(12D3KooW\w+\) for outer step \d+: (its digest|no live member's record attests)",
            line,
        )
        for _, line in refusals
    )
    assert any(": its digest" in line for _, line in refusals), refusals  # a forgery caught by its digest
    assert "caught up with" in run.logs["n"]
    # nobody ever held a state its lineage's holders did not sign: every site that held a state of one
    # outer step and lineage held the same bits (two groups formed at one boundary step two lineages)
    held: dict[tuple[int, str], set[str]] = {}
    for name in (*FIRST, "n"):
        for entry in run.rounds(name):
            if entry["action"] in ("apply", "resync"):
                held.setdefault((entry["outer_round"], entry["lineage"]), set()).add(entry["digest"])
    assert held and all(len(digests) == 1 for digests in held.values()), held
    assert sum(run.summary(name)["refused_states"] for name in (*FIRST, "n")) >= 1


def test_a_revoked_member_is_refused_within_one_round(run: Run) -> None:
    # p learned it was revoked, stopped after its last checkpoint and summary, and said so in one line
    assert run.codes["p"] == 2, run.logs["p"][-3000:]
    assert "this site is no longer a member" in run.logs["p"]
    assert (run.tmp / "p" / "summary.json").exists()
    for name in (*HONEST, "n"):
        assert run.codes[name] == 0, run.logs[name][-3000:]
        assert "revocation list #1 in force" in run.logs[name], name
        late = [
            r for r in run.rounds(name)
            if "p" in r["members"] and r["wall_time"] > run.revoked_at + ROUND_WALL_S + 1.0
        ]  # fmt: skip
        assert late == [], (name, late)
        after = [r for r in run.rounds(name) if r["action"] == "apply" and r["wall_time"] > run.revoked_at]
        # the three that averaged with p go on without it, and so does the newcomer: it caught up before
        # the revocation, and a site on the head joins the next group (StateSync.heal_due catches a
        # laggard up between rounds, not at the boundary where it would miss the group)
        assert after, (name, "no round after the revocation")
