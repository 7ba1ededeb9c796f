"""Traces kept compressed (gzip, xz, bzip2): read as the plain file reads, recognised by their bytes,
and a damaged or mislabelled file fails with one line naming it."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from greenswarm.errors import TraceError
from greenswarm.traces import load_trace, read_csv_trace
from tests._shared import shared_path

COMPRESSORS: dict[str, tuple[str, Callable[[bytes], bytes]]] = {
    "gzip": (".gz", gzip.compress),
    "xz": (".xz", lzma.compress),
    "bzip2": (".bz2", bz2.compress),
}

EM_HEADER = (
    "Datetime (UTC),Country,Zone Name,Zone Id,Carbon Intensity gCO₂eq/kWh (direct),"
    "Carbon Intensity gCO₂eq/kWh (LCA),Low Carbon Percentage,Renewable Percentage,Data Source,"
    "Data Estimated,Data Estimation Method\n"
)


def em_text(hours: int = 48) -> bytes:
    """An Electricity Maps export of ``hours`` hourly rows (with the byte-order mark some tools add)."""
    start = datetime(2023, 1, 1)
    rows = [
        f"{start + timedelta(hours=h):%Y-%m-%d %H:%M:%S},Germany,Germany,DE,{50 + 7 * h % 130},{90 + h},"
        "80,70,entsoe.eu,false,\n"
        for h in range(hours)
    ]
    return ("\ufeff" + EM_HEADER + "".join(rows)).encode("utf-8")


def same(a, b) -> bool:
    return (
        a.regions == b.regions
        and np.array_equal(a.times, b.times)
        and all(np.array_equal(a.series(r), b.series(r)) for r in a.regions)
    )


@pytest.mark.parametrize("kind", sorted(COMPRESSORS))
def test_a_compressed_trace_reads_as_the_plain_one(tmp_path: Path, kind: str) -> None:
    suffix, compress = COMPRESSORS[kind]
    plain = tmp_path / "de.csv"
    plain.write_bytes(em_text())
    packed = tmp_path / f"de.csv{suffix}"
    packed.write_bytes(compress(em_text()))
    assert same(load_trace(str(packed)), load_trace(str(plain)))
    assert same(load_trace(str(packed), variant="lca"), load_trace(str(plain), variant="lca"))


def test_compression_is_recognised_by_the_bytes_not_the_name(tmp_path: Path) -> None:
    renamed = tmp_path / "de-export"  # fetched and saved without its .gz
    renamed.write_bytes(gzip.compress(em_text()))
    plain = tmp_path / "de.csv"
    plain.write_bytes(em_text())
    assert same(load_trace(str(renamed)), load_trace(str(plain)))


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("de.csv.gz", em_text(), "the name says gzip, but the file is not compressed"),
        ("de.csv.gz", lzma.compress(em_text()), "the name says gzip, but the file is xz-compressed"),
        ("de.csv.xz", gzip.compress(em_text()), "the name says xz, but the file is gzip-compressed"),
        ("de.csv.bz2", em_text(), "the name says bzip2, but the file is not compressed"),
    ],
)
def test_a_name_that_promises_another_compression_is_named(
    tmp_path: Path, name: str, content: bytes, match: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(TraceError, match=match) as info:
        load_trace(str(path))
    assert str(info.value).startswith(f"{path}: ")


@pytest.mark.parametrize("kind", sorted(COMPRESSORS))
@pytest.mark.parametrize("damage", ["truncated", "corrupted"])
def test_damaged_compressed_data_is_one_line_naming_the_file(tmp_path: Path, kind: str, damage: str) -> None:
    suffix, compress = COMPRESSORS[kind]
    data = bytearray(compress(em_text(hours=2000)))
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:  # flip bytes in the middle of the stream (its checksum, or the decoder, must notice)
        for i in range(len(data) // 2, len(data) // 2 + 64):
            data[i] ^= 0x5A
    path = tmp_path / f"de.csv{suffix}"
    path.write_bytes(bytes(data))
    with pytest.raises(TraceError) as info:
        load_trace(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}") and "\n" not in message
    if damage == "truncated":
        assert f"damaged {kind} data" in message
    # (corrupted: each format checks its CRC at the end of a block or stream, so garbled text may
    # meet the CSV checks first -- a bad cell at a named line; text that parsed would still fail at
    # the checksum, as the whole file is read before the trace is used)


def test_a_directory_is_not_a_trace_file(tmp_path: Path) -> None:
    """(load_trace reads a directory as the traces in it: tests/test_merged_traces.py)"""
    with pytest.raises(TraceError, match="is a directory, not a trace file"):
        read_csv_trace(tmp_path)


@pytest.mark.shared
def test_windows_reads_a_real_export_gzipped(tmp_path: Path) -> None:
    """``greenswarm windows --trace X.csv.gz``: the same windows as the plain export."""
    source = shared_path("traces/electricitymaps-2023/GB_2023_hourly.csv")
    packed = tmp_path / "GB_2023_hourly.csv.gz"
    packed.write_bytes(gzip.compress(source.read_bytes()))
    reports = []
    for trace in (source, packed):
        command = ["windows", "--trace", str(trace), "--region", "GB", "--json"]
        result = subprocess.run(
            [sys.executable, "-m", "greenswarm", *command],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        report.pop("trace", None)  # (names the file it read)
        reports.append(report)
    assert reports[0] == reports[1]
    assert reports[0]["windows"]
