"""Run a test module's worker in ``world`` spawned processes and collect what they report, under a
deadline, so that a hung collective fails the test instead of hanging CI."""

from __future__ import annotations

import multiprocessing
import queue as queue_mod
import time

import pytest


def run_ranks(worker, world: int, cases, store: str, timeout: float) -> list:
    """``worker(rank, world, store, cases, q)`` in ``world`` processes; each puts
    ``(rank, name, ok, result)`` on ``q`` per case and ``(rank, "<done>", ...)`` at the end.
    Returns every case item, in arrival order."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, store, cases, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results, done, deadline = [], 0, time.monotonic() + timeout
    try:
        while done < world:
            try:
                item = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_mod.Empty:
                pytest.fail(f"{world}-process run timed out after {timeout} s; results so far: {results}")
            if item[1] == "<done>":
                done += 1
            else:
                results.append(item)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return results
