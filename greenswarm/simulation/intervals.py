"""Sets of half-open time intervals as sorted ``(n, 2)`` float arrays, and the few operations on them
the simulator needs.

A site's simulated life is a handful of interval sets (training, powered but idle); a year of hourly
windows is a few hundred intervals per site, so plain sorted arrays and numpy beat any interval-tree.
"""

from __future__ import annotations

import numpy as np

EMPTY = np.zeros((0, 2))


def as_intervals(pairs) -> np.ndarray:
    """``pairs`` as a sorted ``(n, 2)`` array with empty intervals dropped and overlaps merged."""
    arr = np.asarray(pairs, dtype=np.float64).reshape(-1, 2)
    arr = arr[arr[:, 1] > arr[:, 0]]
    if len(arr) < 2:
        return arr
    arr = arr[np.argsort(arr[:, 0], kind="stable")]
    # merge: a new group starts where the start exceeds the running max of previous ends
    ends = np.maximum.accumulate(arr[:, 1])
    new = np.concatenate(([True], arr[1:, 0] > ends[:-1]))
    group = np.cumsum(new) - 1
    starts = arr[new, 0]
    stops = np.zeros(len(starts))
    np.maximum.at(stops, group, arr[:, 1])
    return np.column_stack([starts, stops])


def total(intervals: np.ndarray) -> float:
    """Summed length in seconds."""
    return float(np.sum(intervals[:, 1] - intervals[:, 0])) if len(intervals) else 0.0


def clip(intervals: np.ndarray, t0: float, t1: float) -> np.ndarray:
    """The parts of ``intervals`` inside ``[t0, t1)``."""
    if not len(intervals):
        return intervals
    out = np.column_stack([np.maximum(intervals[:, 0], t0), np.minimum(intervals[:, 1], t1)])
    return out[out[:, 1] > out[:, 0]]


def coverage(sets: list[np.ndarray], weights: list[float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """How many of ``sets`` (each optionally weighted) cover each stretch of time.

    Returns ``(edges, counts)`` with ``counts[i]`` holding on ``[edges[i], edges[i+1])``. One sweep
    answers "hours with 0/1/2/3+ sites", the federated stretches, and (with weights) intersections
    and differences, so there is one piece of interval arithmetic to get right.
    """
    weights = [1.0] * len(sets) if weights is None else weights
    starts = np.concatenate([s[:, 0] for s in sets] + [np.zeros(0)])
    stops = np.concatenate([s[:, 1] for s in sets] + [np.zeros(0)])
    w = np.concatenate([np.full(len(s), wt) for s, wt in zip(sets, weights, strict=True)] + [np.zeros(0)])
    times = np.concatenate([starts, stops])
    delta = np.concatenate([w, -w])
    if not len(times):
        return np.zeros(0), np.zeros(0)
    order = np.argsort(times, kind="stable")
    times, delta = times[order], delta[order]
    edges, first = np.unique(times, return_index=True)
    return edges, np.round(np.cumsum(np.add.reduceat(delta, first))[:-1], 9)


def where_count(edges: np.ndarray, counts: np.ndarray, predicate) -> np.ndarray:
    """The intervals of a :func:`coverage` result on which ``predicate(count)`` holds."""
    if len(edges) < 2:
        return EMPTY.copy()
    keep = predicate(counts)
    return as_intervals(np.column_stack([edges[:-1][keep], edges[1:][keep]]))


def intersect(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a ∩ b`` for two interval sets."""
    edges, counts = coverage([a, b], [1.0, 2.0])
    return where_count(edges, counts, lambda c: c == 3.0)


def subtract(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a \\ b`` for two interval sets."""
    edges, counts = coverage([a, b], [1.0, 2.0])
    return where_count(edges, counts, lambda c: c == 1.0)
