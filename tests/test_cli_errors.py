"""The CLI as a user meets it: a mistake in the input gives one line naming the culprit and a
non-zero exit, never a traceback, and no p2pd daemon is left behind.

Every case runs the real command in a subprocess (its own session), so the leak check can tell this
test's daemons from those of anything else running on the machine.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

from greenswarm.bootstrap.identity import load_or_create_identity

TIMEOUT_S = 60
BUILTIN_REGIONS = "CAISO_NORTH, SPP_TX, NEM_SA"

#: session ids (= leader pids) of the commands the current test started
_sessions: list[int] = []


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def _session_of(proc: psutil.Process) -> int | None:
    try:
        return os.getsid(proc.pid)
    except (ProcessLookupError, PermissionError):
        return None


def _left_in_sessions(sessions: list[int], since: float) -> list[psutil.Process]:
    """Live processes (p2pd daemons above all) still in a session this test started."""
    left = []
    for proc in psutil.process_iter(["name", "create_time"]):
        try:
            if proc.info["create_time"] < since - 1 or proc.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if _session_of(proc) in sessions:
            left.append(proc)
    return left


@pytest.fixture(autouse=True)
def no_daemon_left() -> Iterator[None]:
    """After each test, no process started by this test's commands may survive them (p2pd orphans,
    whose parent exited without reaping them, are the usual culprit). Survivors are killed, then the
    test fails. Only this test's sessions are inspected, so parallel runs are never touched."""
    _sessions.clear()
    t0 = time.time()
    yield
    deadline = time.monotonic() + 10
    left = _left_in_sessions(_sessions, t0)
    while left and time.monotonic() < deadline:  # a daemon that is being stopped exits within moments
        time.sleep(0.25)
        left = _left_in_sessions(_sessions, t0)
    described = []
    for proc in left:
        try:
            orphan = proc.parent() is None or proc.ppid() == 1
            described.append(f"{proc.name()} (pid {proc.pid}{', orphaned' if orphan else ''})")
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    if described:
        pytest.fail(f"left running after the command exited: {', '.join(described)}")


def greenswarm(
    *args: str, cwd: Path, timeout: float = TIMEOUT_S, env: dict[str, str] | None = None
) -> Result:
    """Run ``python -m greenswarm ARGS`` in its own session; kill the whole session on a timeout."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "greenswarm", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
    )
    _sessions.append(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"greenswarm {' '.join(args)} did not exit within {timeout} s; stderr:\n{err[-3000:]}")
    return Result(proc.returncode, out, err)


def assert_one_error_line(result: Result, command: str, *needles: str) -> str:
    """Non-zero exit, no traceback, and exactly one ``greenswarm CMD: error: ...`` line, the last one,
    naming every needle."""
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(f"greenswarm {command}: error: ")]
    assert len(errors) == 1, result.stderr
    assert lines[-1] == errors[0], result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def peer_id(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A valid peer id nobody runs: addresses with it are well-formed but unreachable."""
    return load_or_create_identity(tmp_path_factory.mktemp("identity") / "nobody.key")


@pytest.fixture
def unreachable(peer_id: str) -> str:
    """A well-formed bootstrap multiaddr on a loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id}"


def config(tmp_path: Path, body: str = "name: ok\nregion: CAISO_NORTH\n", name: str = "ok.yaml") -> Path:
    """A site config on loopback with its run_dir in tmp_path (plus ``body``'s fields)."""
    path = tmp_path / name
    path.write_text(
        body + "swarm: {host_maddrs: [/ip4/127.0.0.1/tcp/0]}\n" + f"node: {{run_dir: {tmp_path / 'run'}}}\n"
    )
    return path


def test_node_missing_config(tmp_path: Path) -> None:
    """A mistyped --config path is named."""
    result = greenswarm("node", "--config", "missing.yaml", cwd=tmp_path)
    assert_one_error_line(result, "node", "missing.yaml", "not found")


def test_node_unknown_field(tmp_path: Path) -> None:
    """A typo in a section name gives file:line, the field and the suggestion."""
    path = config(tmp_path, "name: ok\nregion: CAISO_NORTH\ntrian:\n  lr: 1e-3\n")
    result = greenswarm("node", "--config", str(path), cwd=tmp_path)
    assert_one_error_line(result, "node", f"{path}:3", "trian", "did you mean 'train'")


def test_node_missing_field(tmp_path: Path) -> None:
    """Leaving out ``region`` is named with the file."""
    path = config(tmp_path, "name: ok\n")
    result = greenswarm("node", "--config", str(path), cwd=tmp_path)
    assert_one_error_line(result, "node", str(path), "region", "missing required field")


def test_node_bad_override(tmp_path: Path) -> None:
    """A bad ``--set`` names the override itself."""
    result = greenswarm("node", "--config", str(config(tmp_path)), "--set", "train.lr=fast", cwd=tmp_path)
    assert_one_error_line(result, "node", "--set train.lr=fast", "expected a number")


def test_node_garbage_initial_peers(tmp_path: Path) -> None:
    """A malformed --initial-peers is refused before anything starts, naming the flag and the value."""
    result = greenswarm("node", "--config", str(config(tmp_path)), "--initial-peers", "garbage", cwd=tmp_path)
    assert_one_error_line(result, "node", "--initial-peers", "'garbage'", "12D3KooW")


def test_node_unreachable_swarm(tmp_path: Path, unreachable: str) -> None:
    """A well-formed but dead bootstrap address: the node says the swarm cannot be reached and exits,
    after the retries it was given (a site retries for 15 s by default, five DHT starts: ~25 s on a
    quiet machine; here one retry after 0.5 s)."""
    result = greenswarm(
        "node", "--config", str(config(tmp_path)), "--initial-peers", unreachable,
        "--set", "swarm.join_retry_s=[0.5]", cwd=tmp_path, timeout=2 * TIMEOUT_S,
    )  # fmt: skip
    assert_one_error_line(result, "node", "cannot reach the swarm", unreachable, "in 2 tries over 0.5 s")


def test_node_region_not_in_trace(tmp_path: Path) -> None:
    """A region the trace lacks is refused with the regions it has."""
    path = config(tmp_path, "name: ok\nregion: NOWHERE\n")
    result = greenswarm("node", "--config", str(path), cwd=tmp_path)
    assert_one_error_line(result, "node", "NOWHERE", BUILTIN_REGIONS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: cuda is a valid choice here")
def test_node_cuda_without_a_gpu(tmp_path: Path) -> None:
    """``train.device: cuda`` on a machine without one names the field (not a torch traceback)."""
    path = config(tmp_path, "name: ok\nregion: CAISO_NORTH\ntrain: {device: cuda}\n")
    result = greenswarm("node", "--config", str(path), cwd=tmp_path)
    assert_one_error_line(result, "node", str(path), "train.device", "no usable CUDA GPU")


def test_node_unknown_fault_point(tmp_path: Path) -> None:
    """A mistyped GREENSWARM_FAULTS (a test hook) is refused by name, before the node joins anything."""
    result = greenswarm(
        "node", "--config", str(config(tmp_path)), cwd=tmp_path, env={"GREENSWARM_FAULTS": "boom@1"}
    )
    assert_one_error_line(result, "node", "GREENSWARM_FAULTS", "unknown fault point 'boom'")


def test_progress_garbage_initial_peers(tmp_path: Path) -> None:
    """``progress`` checks its addresses like ``node`` does."""
    result = greenswarm("progress", "--initial-peers", "garbage", cwd=tmp_path)
    assert_one_error_line(result, "progress", "--initial-peers", "'garbage'")


def test_progress_unreachable_swarm(tmp_path: Path, unreachable: str) -> None:
    """``progress`` against a dead bootstrap exits non-zero instead of printing an empty table."""
    result = greenswarm("progress", "--initial-peers", unreachable, cwd=tmp_path)
    assert_one_error_line(result, "progress", "cannot reach the swarm", unreachable)
    assert result.stdout.strip() == ""


def test_bootstrap_corrupted_identity(tmp_path: Path) -> None:
    """A damaged key file is named; the bootstrap peer never starts with a new, different id."""
    key = tmp_path / "boot.key"
    key.write_bytes(b"not a key at all\n")
    result = greenswarm("bootstrap", "--identity", str(key), "--listen", "/ip4/127.0.0.1/tcp/0", cwd=tmp_path)
    assert_one_error_line(result, "bootstrap", str(key))
    assert key.read_bytes() == b"not a key at all\n"  # left for the user to inspect, not overwritten


def test_bootstrap_bad_listen(tmp_path: Path) -> None:
    """A malformed --listen address names the field."""
    result = greenswarm(
        "bootstrap", "--identity", str(tmp_path / "boot.key"), "--listen", "0.0.0.0:31337", cwd=tmp_path
    )
    assert_one_error_line(result, "bootstrap", "listen", "0.0.0.0:31337")


def test_demo_unknown_region(tmp_path: Path) -> None:
    """The demo checks its regions before starting any process."""
    result = greenswarm("demo", "--regions", "NOWHERE", "--no-live", cwd=tmp_path)
    assert_one_error_line(result, "demo", "--regions", "NOWHERE", BUILTIN_REGIONS)


def test_help(tmp_path: Path) -> None:
    """``--help`` works and shows the subcommands and a node's flags."""
    top = greenswarm("--help", cwd=tmp_path)
    assert top.returncode == 0, top.stderr
    for word in ("bootstrap", "node", "progress", "demo", "--initial-peers"):
        assert word in top.stdout
    node = greenswarm("node", "--help", cwd=tmp_path)
    assert node.returncode == 0, node.stderr
    for flag in ("--config", "--initial-peers", "--set", "--run-dir"):
        assert flag in node.stdout


@pytest.mark.parametrize("output", [[], ["--json"]], ids=["table", "json"])
def test_a_reader_that_goes_away_ends_the_command_quietly(output: list[str]) -> None:
    """``greenswarm windows ... | head -0``: the pipe is closed before the command writes; it stops
    without a traceback, whether it prints a rich table or plain JSON."""
    command = ["windows", "--trace", "builtin", "--region", "CAISO_NORTH", *output]
    proc = subprocess.Popen(
        [sys.executable, "-m", "greenswarm", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read()
    assert proc.wait(timeout=60) != 0
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()[-2000:]
