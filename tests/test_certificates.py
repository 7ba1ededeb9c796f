"""Membership certificates (issue #7, part 1): the authority key, issuing, and every refusal."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from greenswarm.bootstrap.identity import load_or_create_identity
from greenswarm.security.certificates import (
    CertificateError,
    create_authority,
    issue,
    load_authority_public,
    parse_validity,
    verify,
)
from tests.conftest import site_config, write_trace

pytestmark = pytest.mark.security


@pytest.fixture
def peer_id(tmp_path: Path) -> str:
    return load_or_create_identity(tmp_path / "site.key")


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "greenswarm", "swarm", *args], capture_output=True, text=True, cwd=tmp_path
    )


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_init_admit_check_through_the_cli(tmp_path: Path, peer_id: str) -> None:
    shown = _cli(tmp_path, "id", "--identity", "site.key", "--json")  # what a site sends the operator
    assert shown.returncode == 0 and json.loads(shown.stdout)["peer_id"] == peer_id, shown.stderr
    assert _cli(tmp_path, "init", "--key", "authority.key").returncode == 0
    assert _mode(tmp_path / "authority.key") == 0o600 and (tmp_path / "authority.key.pub").exists()
    again = _cli(tmp_path, "init", "--key", "authority.key")
    assert again.returncode != 0 and "refusing to overwrite" in again.stderr
    admit = _cli(tmp_path, "admit", "--key", "authority.key", "--swarm", "s", "--site", "a", "--region", "R",
                 "--peer-id", peer_id, "--expires", "30d", "--out", "a.cert", "--json")  # fmt: skip
    assert admit.returncode == 0, admit.stderr
    assert _mode(tmp_path / "a.cert") == 0o600
    issued = json.loads(admit.stdout)
    assert issued["expires"] - issued["issued"] == pytest.approx(30 * 86400)
    check = _cli(tmp_path, "check", "a.cert", "--authority", "authority.key.pub", "--swarm", "s",
                 "--peer-id", peer_id, "--json")  # fmt: skip
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["site"] == "a"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["admit", "--key", "missing.key", "--site", "a", "--region", "R", "--peer-id", "X", "--out", "c"],
         "is not a libp2p peer id"),
        (["check", "missing.cert", "--authority", "missing.pub"], "no such"),
        (["admit", "--key", "missing.key", "--site", "a", "--region", "R", "--peer-id", "PEER", "--out", "c"],
         "no such authority key file"),
        (["admit", "--key", "missing.key", "--site", "a", "--region", "R", "--peer-id", "PEER",
          "--expires", "soon", "--out", "c"], "--expires"),
    ],
)  # fmt: skip
def test_cli_errors_are_one_line(tmp_path: Path, peer_id: str, args: list[str], message: str) -> None:
    out = _cli(tmp_path, *[peer_id if a == "PEER" else a for a in args])
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in out.stderr, out.stderr


def _issued(tmp_path: Path, peer_id: str, **kw) -> tuple[Path, object]:  # noqa: ANN003
    key, public = create_authority(tmp_path / "authority.key")
    cert = tmp_path / "a.cert"
    issue(
        key, swarm="s", site="a", region="R", peer_id=peer_id, valid_s=kw.pop("valid_s", 3600), out=cert, **kw
    )
    return cert, load_authority_public(public)


def test_a_valid_certificate_verifies(tmp_path: Path, peer_id: str) -> None:
    cert, authority = _issued(tmp_path, peer_id)
    membership = verify(cert, authority, swarm="s", peer_id=peer_id)
    assert (membership.site, membership.region, membership.peer_id) == ("a", "R", peer_id)


def test_an_edited_certificate_is_forged(tmp_path: Path, peer_id: str) -> None:
    cert, authority = _issued(tmp_path, peer_id)
    data = json.loads(cert.read_text())
    data["membership"]["site"] = "intruder"
    cert.write_text(json.dumps(data))
    with pytest.raises(CertificateError, match="forged or edited"):
        verify(cert, authority)


def test_another_authoritys_certificate_is_refused(tmp_path: Path, peer_id: str) -> None:
    cert, _ = _issued(tmp_path, peer_id)
    _, other_public = create_authority(tmp_path / "other.key")
    with pytest.raises(CertificateError, match="another authority"):
        verify(cert, load_authority_public(other_public))


def test_expired_and_not_yet_valid(tmp_path: Path, peer_id: str) -> None:
    cert, authority = _issued(tmp_path, peer_id, valid_s=60, now=time.time() - 120)
    with pytest.raises(CertificateError, match="expired at"):
        verify(cert, authority)
    cert.unlink()
    (tmp_path / "authority.key").unlink()
    cert, authority = _issued(tmp_path, peer_id, valid_s=60, now=time.time() + 3600)
    with pytest.raises(CertificateError, match="not valid yet"):
        verify(cert, authority)


def test_someone_elses_certificate_or_swarm_is_refused(tmp_path: Path, peer_id: str) -> None:
    cert, authority = _issued(tmp_path, peer_id)
    other = load_or_create_identity(tmp_path / "other-site.key")
    with pytest.raises(CertificateError, match="belongs to one identity file"):
        verify(cert, authority, peer_id=other)
    with pytest.raises(CertificateError, match="issued for swarm 's'"):
        verify(cert, authority, swarm="another")


def test_garbage_files_name_themselves(tmp_path: Path, peer_id: str) -> None:
    cert, authority = _issued(tmp_path, peer_id)
    cert.write_text("{not json")
    with pytest.raises(CertificateError, match=f"{cert}: not a greenswarm membership certificate"):
        verify(cert, authority)
    bad = tmp_path / "bad.pub"
    bad.write_text("-----BEGIN PUBLIC KEY-----\ngarbage\n-----END PUBLIC KEY-----\n")
    with pytest.raises(CertificateError, match=f"{bad}: not a PEM public key"):
        load_authority_public(bad)


@pytest.mark.parametrize(("text", "seconds"), [("30d", 30 * 86400), ("12h", 43200), ("90m", 5400)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_validity(text) == seconds


def _site_yaml(tmp_path: Path, name: str, **swarm: str) -> Path:
    trace = write_trace(tmp_path / "green.csv", {"R": [10.0] * 4}, step_s=3600)
    cfg = site_config(name, "R", trace, [], tmp_path / name, speedup=300.0, start_wall=time.time(),
                      sync_s=600.0, swarm={"name": "s", **swarm}, node={"restart": "never"})  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_certificate_needs_its_authority_and_an_identity(tmp_path: Path) -> None:
    from greenswarm.errors import ConfigError
    from greenswarm.node.config import load_site_config

    with pytest.raises(ConfigError, match="authority"):
        load_site_config(_site_yaml(tmp_path, "a", certificate="a.cert"))
    with pytest.raises(ConfigError, match="identity"):
        load_site_config(_site_yaml(tmp_path, "a", certificate="a.cert", authority="authority.key.pub"))


@pytest.mark.swarm
def test_a_node_starts_only_with_its_own_certificate(tmp_path: Path, peer_id: str) -> None:
    key, public = create_authority(tmp_path / "authority.key")
    issue(key, swarm="s", site="a", region="R", peer_id=peer_id, valid_s=3600, out=tmp_path / "a.cert")
    swarm = {
        "certificate": str(tmp_path / "a.cert"),
        "authority": str(public),
        "identity": str(tmp_path / "site.key"),
    }
    wrong = subprocess.run(
        [sys.executable, "-m", "greenswarm", "node", "--config", str(_site_yaml(tmp_path, "b", **swarm))],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert wrong.returncode == 2, wrong.stderr[-2000:]
    assert "issued to site 'a' in 'R', but this config is 'b'" in wrong.stderr
    ok = subprocess.Popen(
        [sys.executable, "-m", "greenswarm", "node", "--config", str(_site_yaml(tmp_path, "a", **swarm))],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out = ""
        for line in ok.stdout:
            out += line
            if "admitted to swarm 's'" in line or "first training step" in line:
                break
        assert "admitted to swarm 's' until" in out, out[-2000:]
    finally:
        ok.terminate()
        ok.wait(timeout=60)
