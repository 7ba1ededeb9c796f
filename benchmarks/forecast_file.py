"""Build a forecast file from a trace: the forecasts a site could really have had, issued over time.

Each issue at time ``g`` (every ``--every-h`` hours) forecasts the next ``--horizon-h`` hours of a
region with what was known at ``g``: seasonal naive, the value 24 h before each instant when that is
at or before ``g``, else the value at ``g`` (persistence). Written in WattTime's historical-forecast
shape, ``generated_at,point_time,value`` plus a ``region`` column, for
``greenswarm simulate --policy deadline --forecast file:PATH``:

    python benchmarks/forecast_file.py --trace ../shared/data/traces/curtail-llm/mci.csv \\
        --out forecasts.csv.gz [--every-h 1] [--horizon-h 24]

A ``.gz`` output is gzip'ed (the forecast reader takes it as it is).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from greenswarm.timefmt import iso_utc  # noqa: E402
from greenswarm.traces import load_trace  # noqa: E402

DAY_S = 86400.0


def forecast_rows(trace, every_s: float, horizon_s: float):
    """(generated_at, point_time, region, value) rows: seasonal naive, known at each issue time."""
    step = trace.resolution_s
    for generated in np.arange(trace.start, trace.end, every_s):
        points = generated + step * np.arange(1, int(horizon_s // step) + 1)
        points = points[points < trace.end]
        for region in trace.regions:
            now = trace.intensity(region, generated)
            for t in points:
                yesterday = t - DAY_S
                value = trace.intensity(region, yesterday) if trace.start <= yesterday <= generated else now
                yield generated, t, region, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True, help="the trace to forecast (any file greenswarm reads)")
    parser.add_argument("--out", required=True, help="the forecast file to write (.csv or .csv.gz)")
    parser.add_argument("--every-h", type=float, default=1.0, help="hours between issues (default 1)")
    parser.add_argument("--horizon-h", type=float, default=24.0, help="hours each issue covers (default 24)")
    parser.add_argument("--tz", help="IANA zone of the trace's naive timestamps")
    args = parser.parse_args()
    trace = load_trace(args.trace, args.tz)
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["generated_at", "point_time", "region", "value"])
    count = 0
    for generated, t, region, value in forecast_rows(trace, args.every_h * 3600, args.horizon_h * 3600):
        writer.writerow([iso_utc(generated), iso_utc(t), region, f"{value:.4f}"])
        count += 1
    data = text.getvalue().encode()
    Path(args.out).write_bytes(gzip.compress(data) if args.out.endswith(".gz") else data)
    print(f"{args.out}: {count} forecast values, {len(trace.regions)} region(s), from {trace.source}")


if __name__ == "__main__":
    main()
