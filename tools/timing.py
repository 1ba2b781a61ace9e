"""Timing helpers of the benchmark tools: each contender called in turn, round after round, and the seconds'
median, min and max (bench, progress_cost and vs_blog time with them; none of them owns the others)."""

from __future__ import annotations

import statistics
import time


def stats(samples: list[float]) -> dict:
    """median/min/max of a list of seconds."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def timed(fns: dict, runs: int, rounds: list | None = None) -> dict:
    """Seconds per call of each ``fns[name]()`` (each must block until done), interleaved.

    Every function is called once to warm up; then ``runs`` rounds call each function once, in
    turn, so a noisy neighbour slows all of them alike and their ratios stay comparable.
    Returns {name: stats}; ``rounds``, if given, receives each round's {name: seconds} (for paired ratios).
    """
    for fn in fns.values():
        fn()
    samples = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
        if rounds is not None:
            rounds.append({name: values[-1] for name, values in samples.items()})
    return {name: stats(values) for name, values in samples.items()}
