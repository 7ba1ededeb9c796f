"""Atomic checkpoints: a crash mid-save must never cost a site its last good state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from greenswarm.errors import StorageError
from greenswarm.node.checkpoint import Checkpointer, content_digest


def payload(step: int) -> dict[str, object]:
    return {
        "outer": [torch.full((3,), float(step)), torch.zeros(3)],
        "site": {"local_steps": step},
        "optimizer": {
            "state": {0: {"step": torch.tensor(float(step)), "mask": torch.ones(2, dtype=torch.bool)}}
        },
    }


def test_round_trip(tmp_path: Path) -> None:
    """What is saved is what comes back (tensors and plain data), newest first."""
    ckpt = Checkpointer(tmp_path / "run")
    assert ckpt.save(payload(1)) == tmp_path / "run" / "checkpoint.pt"
    ckpt.save(payload(2))
    loaded = ckpt.load()
    assert loaded is not None
    assert loaded["site"] == {"local_steps": 2}
    assert torch.equal(loaded["outer"][0], torch.full((3,), 2.0))
    assert (tmp_path / "run" / "checkpoint.prev.pt").exists()


def test_new_checkpointer_reads_an_old_directory(tmp_path: Path) -> None:
    """A restarted node builds a fresh Checkpointer on the same run_dir and resumes."""
    Checkpointer(tmp_path).save(payload(5))
    loaded = Checkpointer(tmp_path).load()
    assert loaded is not None and loaded["site"]["local_steps"] == 5


def test_torn_newest_file_falls_back_to_previous(tmp_path: Path) -> None:
    """A corrupted checkpoint.pt (torn write, disk error) loads checkpoint.prev.pt instead."""
    ckpt = Checkpointer(tmp_path)
    ckpt.save(payload(1))
    ckpt.save(payload(2))
    data = ckpt.path.read_bytes()
    ckpt.path.write_bytes(data[: len(data) // 2])  # torn
    loaded = ckpt.load()
    assert loaded is not None and loaded["site"]["local_steps"] == 1
    ckpt.path.write_bytes(b"\x00garbage, not a torch file" * 10)  # plain garbage
    loaded = ckpt.load()
    assert loaded is not None and loaded["site"]["local_steps"] == 1


def test_unknown_format_is_ignored(tmp_path: Path) -> None:
    """A readable file of another format (not a dict with our version) is not trusted as a checkpoint."""
    ckpt = Checkpointer(tmp_path)
    ckpt.save(payload(1))
    ckpt.save(payload(2))
    torch.save([1, 2, 3], ckpt.path)
    loaded = ckpt.load()
    assert loaded is not None and loaded["site"]["local_steps"] == 1


def test_both_unreadable_is_none(tmp_path: Path) -> None:
    """With no readable checkpoint the node starts fresh rather than crashing."""
    ckpt = Checkpointer(tmp_path)
    ckpt.path.write_bytes(b"junk")
    ckpt.previous.write_bytes(b"junk")
    assert ckpt.load() is None


def test_missing_directory_is_none(tmp_path: Path) -> None:
    """A first start (no run_dir yet) is not an error, and loading creates nothing."""
    ckpt = Checkpointer(tmp_path / "does" / "not" / "exist")
    assert ckpt.load() is None
    assert not (tmp_path / "does").exists()


def test_save_leaves_no_tmp_file(tmp_path: Path) -> None:
    """The temporary file is renamed into place; only the two checkpoints remain."""
    ckpt = Checkpointer(tmp_path / "run")
    for step in range(3):
        ckpt.save(payload(step))
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names == ["checkpoint.prev.pt", "checkpoint.pt"]
    assert not list((tmp_path / "run").glob("*.tmp"))


def test_a_flipped_byte_inside_tensor_data_is_detected(tmp_path: Path) -> None:
    """torch.load would return damaged tensor values without complaint; the digest does not."""
    ckpt = Checkpointer(tmp_path)
    ckpt.save(payload(1))
    ckpt.save({"outer": [torch.arange(10_000, dtype=torch.float32)], "site": {"local_steps": 2}})
    data = bytearray(ckpt.path.read_bytes())
    at = data.find(torch.arange(10_000, dtype=torch.float32).numpy().tobytes()[4000:4016])
    assert at > 0
    data[at] ^= 0x01
    ckpt.path.write_bytes(bytes(data))
    loaded = ckpt.load()
    assert loaded is not None and loaded["site"]["local_steps"] == 1


def test_a_plain_torch_load_still_reads_a_checkpoint(tmp_path: Path) -> None:
    """Anyone can take the weights out with torch.load; the digest is just one more key."""
    ckpt = Checkpointer(tmp_path)
    ckpt.save(payload(3))
    raw = torch.load(ckpt.path, weights_only=False)
    assert raw["site"] == {"local_steps": 3} and raw["digest"] == content_digest(
        {k: v for k, v in raw.items() if k not in ("format", "digest")}
    )


def test_a_changed_value_is_detected_even_when_the_file_is_well_formed(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    ckpt.save(payload(1))
    ckpt.save(payload(2))
    raw = torch.load(ckpt.path, weights_only=False)
    raw["outer"][0][1] = 99.0  # rewritten by something that is not greenswarm
    torch.save(raw, ckpt.path)
    loaded = ckpt.load()
    assert loaded is not None and loaded["site"]["local_steps"] == 1


def test_read_verifies_any_checkpoint_file(tmp_path: Path) -> None:
    """``read`` is the per-file check behind ``load``: usable on copies kept elsewhere (best/)."""
    ckpt = Checkpointer(tmp_path)
    ckpt.save(payload(4))
    copy = tmp_path / "elsewhere.pt"
    copy.write_bytes(ckpt.path.read_bytes())
    content = Checkpointer.read(copy)
    assert content is not None and content["site"] == {"local_steps": 4}
    assert content.keys() == ckpt.load().keys()  # the same payload, without format and digest
    assert Checkpointer.read(tmp_path / "missing.pt") is None
    data = bytearray(copy.read_bytes())
    at = data.find(torch.full((3,), 4.0).numpy().tobytes())
    assert at > 0
    data[at] ^= 0x01
    copy.write_bytes(bytes(data))
    assert Checkpointer.read(copy) is None
    torch.save([1, 2, 3], copy)
    assert Checkpointer.read(copy) is None


def test_a_write_that_fails_names_the_file_and_keeps_the_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk (torch says "unexpected pos") is a one-line error naming the file and the space
    left, not torch's traceback; the torn file is removed and the last checkpoint still loads."""
    ckpt = Checkpointer(tmp_path / "run")
    ckpt.save(payload(1))

    def full_disk(obj: object, f: Any) -> None:
        f.write(b"PK partial")
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . unexpected pos 1191806336 vs 1191806224"
        )

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(
        StorageError, match=r"could not write the checkpoint .*checkpoint\.pt\.tmp .*MiB free"
    ):
        ckpt.save(payload(2))
    monkeypatch.undo()
    assert not ckpt.pending.exists()
    loaded = ckpt.load()
    assert loaded is not None and loaded["site"] == {"local_steps": 1}
