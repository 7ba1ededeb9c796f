"""A corpus of malformed inputs to the commands: each gets one line naming the culprit, a non-zero exit,
no traceback, and writes nothing (issue #6).

Each case writes its input files into an empty directory, runs the command in-process (these errors
are all caught before any daemon starts), and then checks that the directory holds exactly the
input files: no run directory, checkpoint, identity or plot was created.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from greenswarm.bootstrap.identity import load_or_create_identity
from greenswarm.cli import main

pytestmark = pytest.mark.faults

GOOD_TRACE = "timestamp,A\n2026-01-01T00:00:00Z,50\n2026-01-01T00:05:00Z,150\n2026-01-01T00:10:00Z,60\n"
SITE = "name: ok\nregion: A\nscheduler: {trace: trace.csv}\nnode: {run_dir: run}\n"


@dataclass
class Case:
    name: str
    args: list[str]
    files: dict[str, str | bytes] = field(default_factory=dict)
    culprit: tuple[str, ...] = ()


def _site(extra: str = "", base: str = SITE) -> dict[str, str | bytes]:
    return {"site.yaml": base + extra, "trace.csv": GOOD_TRACE}


def _trace(body: str | bytes) -> list:
    return [["windows", "--trace", "t.csv", "--region", "A"], {"t.csv": body}]


NODE = ["node", "--config", "site.yaml"]
PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"

CASES = [
    # ---- configs
    Case("config missing", ["node", "--config", "nope.yaml"], {}, ("nope.yaml",)),
    Case("config yaml syntax", NODE, {"site.yaml": "name: ok\nregion: [A\n"}, ("site.yaml",)),
    Case("config not a mapping", NODE, {"site.yaml": "- name\n- region\n"}, ("site.yaml",)),
    Case("config empty", NODE, {"site.yaml": ""}, ("site.yaml",)),
    Case("config unknown section", NODE, _site("trian: {lr: 1.0}\n"), ("site.yaml", "trian")),
    Case("config unknown field", NODE, _site("train: {lrr: 1.0}\n"), ("site.yaml", "train.lrr")),
    Case("config wrong type", NODE, _site("train: {lr: fast}\n"), ("site.yaml", "train.lr")),
    Case("config negative lr", NODE, _site("train: {lr: -1}\n"), ("train.lr",)),
    Case(
        "config nan threshold",
        NODE,
        _site("", SITE.replace("trace.csv}", "trace.csv, threshold: .nan}")),
        ("scheduler.threshold",),
    ),  # fmt: skip
    Case("config unknown wire", NODE, _site("averaging: {wire: int9}\n"), ("averaging.wire",)),
    Case(
        "config request >= matchmaking",
        NODE,
        _site("averaging: {matchmaking_s: 1, request_timeout_s: 2}\n"),
        ("averaging.request_timeout_s",),
    ),  # fmt: skip
    Case(
        "config shard out of range",
        NODE,
        _site("data: {shard_index: 3, num_shards: 2}\n"),
        ("data.shard_index",),
    ),
    Case("config unknown preset", NODE, _site("model: {preset: huge}\n"), ("model.preset",)),
    Case("config bad site name", NODE, _site("", SITE.replace("name: ok", "name: 'a b/c'")), ("name",)),
    Case("config region not in trace", NODE, _site("", SITE.replace("region: A", "region: B")), ("'B'",)),
    Case("override without =", [*NODE, "--set", "train.lr"], _site(), ("--set", "'train.lr'")),
    Case("override unknown field", [*NODE, "--set", "train.nope=1"], _site(), ("train.nope",)),
    Case("config trace missing", NODE, {"site.yaml": SITE}, ("trace.csv",)),
    # ---- traces
    Case("trace missing", ["windows", "--trace", "none.csv", "--region", "A"], {}, ("none.csv",)),
    Case("trace empty", *_trace(""), ("t.csv",)),
    Case("trace header only", *_trace("timestamp,A\n"), ("t.csv",)),
    Case(
        "trace not monotonic",
        *_trace("timestamp,A\n2026-01-01T00:05:00Z,1\n2026-01-01T00:00:00Z,2\n"),
        ("t.csv:3",),
    ),  # fmt: skip
    Case(
        "trace duplicate time",
        *_trace("timestamp,A\n2026-01-01T00:00:00Z,1\n2026-01-01T00:00:00Z,2\n"),
        ("t.csv:3",),
    ),  # fmt: skip
    Case(
        "trace nan value",
        *_trace("timestamp,A\n2026-01-01T00:00:00Z,1\n2026-01-01T00:05:00Z,nan\n"),
        ("t.csv:3",),
    ),  # fmt: skip
    Case(
        "trace negative value",
        *_trace("timestamp,A\n2026-01-01T00:00:00Z,1\n2026-01-01T00:05:00Z,-5\n"),
        ("t.csv:3",),
    ),  # fmt: skip
    Case("trace bad timestamp", *_trace("timestamp,A\nyesterday,1\n2026-01-01T00:05:00Z,2\n"), ("t.csv:2",)),
    Case("trace binary garbage", *_trace(bytes(range(256)) * 4), ("t.csv",)),
    Case(
        "trace unknown region",
        ["windows", "--trace", "t.csv", "--region", "Z"],
        {"t.csv": GOOD_TRACE},
        ("'Z'",),
    ),  # fmt: skip
    # ---- multiaddrs
    Case(
        "initial peer garbage", ["progress", "--initial-peers", "garbage"], {}, ("--initial-peers", "garbage")
    ),
    Case(
        "initial peer without id",
        ["progress", "--initial-peers", "/ip4/127.0.0.1/tcp/4000"],
        {},
        ("--initial-peers",),
    ),  # fmt: skip
    Case(
        "initial peer bad id",
        ["progress", "--initial-peers", "/ip4/127.0.0.1/tcp/4000/p2p/QmNotAnId"],
        {},
        ("--initial-peers",),
    ),  # fmt: skip
    Case(
        "initial peer bad ip",
        ["progress", "--initial-peers", f"/ip4/999.1.1.1/tcp/4000/p2p/{PEER}"],
        {},
        ("--initial-peers",),
    ),  # fmt: skip
    Case("node initial peer garbage", [*NODE, "--initial-peers", "/dns/"], _site(), ("--initial-peers",)),
    Case(
        "listen garbage", ["bootstrap", "--listen", "tcp:31337", "--identity", "boot.key"], {}, ("--listen",)
    ),
    # ---- identity files
    Case(
        "identity garbage",
        ["bootstrap", "--identity", "boot.key"],
        {"boot.key": b"\x00not a key\xff" * 8},
        ("boot.key",),
    ),  # fmt: skip
    Case("identity empty", ["bootstrap", "--identity", "boot.key"], {"boot.key": b""}, ("boot.key",)),
    Case("identity is a directory", ["bootstrap", "--identity", "keys"], {"keys/.keep": ""}, ("keys",)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_malformed_input_gets_one_line_and_writes_nothing(
    case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    for name, content in case.files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    monkeypatch.chdir(tmp_path)
    try:
        code = main(case.args)
    except SystemExit as e:  # argparse usage errors
        code = e.code
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "WARN" not in line]
    assert code not in (0, None), err
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    for culprit in case.culprit:
        assert culprit in lines[0], (culprit, lines[0])
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert after == before, f"wrote {set(after) - set(before)}"


def test_corpus_size() -> None:
    assert len(CASES) >= 30


def test_a_valid_identity_is_left_untouched_by_a_bad_listen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failing start must not rewrite the key it was given."""
    key = tmp_path / "boot.key"
    load_or_create_identity(key)
    data, mode = key.read_bytes(), os.stat(key).st_mode
    monkeypatch.chdir(tmp_path)
    assert main(["bootstrap", "--listen", "nonsense", "--identity", str(key)]) != 0
    assert key.read_bytes() == data and os.stat(key).st_mode == mode


@pytest.mark.swarm
def test_records_from_a_rogue_peer_are_refused_and_never_shown(swarm) -> None:  # noqa: ANN001
    """A peer that skips greenswarm's validators stores garbage under the swarm's keys: the bootstrap's
    validators refuse it, and ``greenswarm progress`` lists nothing and exits cleanly."""
    import json

    from hivemind.utils import get_dht_time

    from greenswarm.averaging.agreement import group_key
    from greenswarm.network import start_dht
    from greenswarm.node.progress import progress_key

    peers = swarm.bootstrap(swarm="test")
    rogue = start_dht(peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True)
    try:
        expiry = get_dht_time() + 60
        key = progress_key("test")
        stored = [
            rogue.store(key, "not a record", expiry, subkey=b"forged-subkey"),
            rogue.store(key, {"site": 7, "state": "HACKED"}, expiry, subkey=b"other"),
            rogue.store(key, b"\x00" * 64, expiry),
        ]
        assert not any(stored), stored
        # round digests are free-form but bounded: a huge or non-string vote is ignored by readers
        rogue.store(group_key("test", 1, "l", ["a", "b"]), {"x": list(range(100))}, expiry, subkey="a")
    finally:
        rogue.shutdown()
    listed = json.loads(swarm.run("progress", "--initial-peers", *peers, "--swarm", "test", "--json").stdout)
    assert listed == []
