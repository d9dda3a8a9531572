"""Repeated attention calls without their host-side decisions: record a call's launches, replay them.

Everything an eager call decides on the host before its kernels run (the route through the mask's
splits, the kernel choice, the tables, the persistent grid, the deal, 40-odd launch arguments per
kernel) is a function of the layout, the tensors' shapes, strides, dtypes, device and 16-byte
alignment, and the call's options. On a GPU that host work takes longer than the kernels of many
16K calls (``benchmarks/NOTES.md``, "Host path"). So a call with a :func:`signature` seen before
only allocates its outputs, puts its tensors into the recorded arguments and launches.

How a signature becomes replayable (``ops/dispatch.py`` decides which routes may try):

1. A call runs normally inside :func:`recording`. Every :class:`~blocksparse_fa.ops.launcher.Launch`
   call, every buffer allocated through :func:`empty` / :func:`zeros`, and every host side call
   registered with :func:`also` (the kernel-choice note, the allocator hook) is kept, in order.
   Tensor operations whose result is a new tensor go through :func:`run`. Tensor arguments that
   are the call's inputs, its allocations or such results become slots; any other tensor is kept
   as a fixed argument (a table cached on the layout, a placeholder).
2. Only a recording that a kernel path vouched for (:func:`vouch`: every GPU operation of that
   path goes through the recorded calls), that nothing declared unfit (:func:`unfit`) and that
   launched something counts.
3. The next call with the same signature records again. Where two consecutive recordings agree
   (the same launches, the same fixed tensors by identity, the same other arguments), later calls
   replay it. Where they differ (a tensor made per call among the arguments; a layout's first call
   that also built its device tables), it records again, up to ``_MAX_RECORDINGS`` times, and then
   the signature is refused for good.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

__all__ = ["signature", "recording", "empty", "zeros", "run", "also", "vouch", "unfit", "Replay", "Refused",
           "settle", "lookup", "clear"]

_state = threading.local()
_MEMO = "call_memo"  # the key of a layout's memo in ``layout.cache``: {(phase, signature): entry}
_MAX_ENTRIES = 64  # signatures kept per layout and phase (a new one beyond evicts the oldest)
# recordings of one signature before it is refused: a layout's first call may build device tables
# with launches of its own, so the first recording can differ from every later one
_MAX_RECORDINGS = 4


def active():
    """The recording of this thread, or None."""
    return getattr(_state, "rec", None)


def signature(tensors, *extra) -> tuple:
    """The key of a call: per tensor its shape, strides, dtype and 16-byte alignment (what selects a
    compiled kernel variant and the descriptor path), the first tensor's device, which tensors are
    one object (``attention(x, x, x)``: a recording's slots follow the objects), and ``extra``
    (hashable: the shapes, scale, options, ...)."""
    alias = None
    if len({id(t) for t in tensors}) < len(tensors):
        alias = tuple(next(j for j, u in enumerate(tensors) if u is t) for t in tensors)
    return (tensors[0].device, alias, *((t.shape, t.stride(), t.dtype, t.data_ptr() & 15) for t in tensors),
            *extra)


class _Slot:
    """A tensor argument filled per call: ``index`` into the call's inputs followed by its allocations."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __eq__(self, other):
        return isinstance(other, _Slot) and other.index == self.index

    def __hash__(self):
        return hash(self.index)


class _Recording:
    __slots__ = ("ids", "keep", "events", "vouched", "fit")

    def __init__(self, inputs):
        self.ids = {id(t): i for i, t in enumerate(inputs)}
        self.keep = list(inputs)  # alive while recording, so that no other tensor takes their ids
        self.events: list = []
        self.vouched = False
        self.fit = True

    def _template(self, args) -> tuple:
        template, slots = [], []
        for pos, a in enumerate(args):
            i = self.ids.get(id(a)) if isinstance(a, torch.Tensor) else None
            if i is None:
                template.append(a)
            else:
                template.append(None)
                slots.append((pos, i))
        return tuple(template), tuple(slots)

    def launch(self, launch, grid, args) -> None:
        self.events.append(("launch", launch, tuple(grid), *self._template(args)))

    def op(self, fn, args, result) -> None:
        self.events.append(("op", fn, None, *self._template(args)))
        self.ids[id(result)] = len(self.keep)
        self.keep.append(result)

    def alloc(self, t: torch.Tensor, zero: bool) -> None:
        self.ids[id(t)] = len(self.keep)
        self.keep.append(t)
        self.events.append(("alloc", tuple(t.shape), t.dtype, t.device, zero))


@contextmanager
def recording(inputs):
    """Record the calls made while active in this thread (see the module docstring); yields the
    recording for :func:`settle`. ``inputs``: the call's tensors, in the order a replay gets them."""
    prev = active()
    rec = _state.rec = _Recording(inputs)
    try:
        yield rec
    finally:
        _state.rec = prev


def _new(shape, dtype, device, zero: bool) -> torch.Tensor:
    t = (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
    rec = active()
    if rec is not None:
        rec.alloc(t, zero)
    return t


def empty(shape, dtype, device) -> torch.Tensor:
    """``torch.empty``, kept by an active recording as a per-call buffer."""
    return _new(shape, dtype, device, False)


def zeros(shape, dtype, device) -> torch.Tensor:
    """``torch.zeros``, kept by an active recording as a per-call buffer."""
    return _new(shape, dtype, device, True)


def run(fn, *args) -> torch.Tensor:
    """``fn(*args)``, a tensor operation of the call whose result is a new tensor: an active
    recording keeps it (the tensors among ``args`` as slots where they are the call's), and a
    replay runs it again with the replayed call's tensors."""
    result = fn(*args)
    rec = active()
    if rec is not None:
        rec.op(fn, args, result)
    return result


def also(fn, *args) -> None:
    """Have a replay call ``fn(*args)`` at this point too (host side effects of a call, such as the
    kernel-choice note or the allocator hook). Only recorded: the caller has already done it."""
    rec = active()
    if rec is not None:
        rec.events.append(("call", fn, args))


def note_launch(launch, grid, args) -> None:
    """A :class:`~blocksparse_fa.ops.launcher.Launch` call, kept by an active recording."""
    rec = active()
    if rec is not None:
        rec.launch(launch, grid, args)


def vouch() -> None:
    """The running kernel path makes every GPU operation of the call through recorded calls."""
    rec = active()
    if rec is not None:
        rec.vouched = True


def unfit() -> None:
    """The running call does something a replay would not repeat (a per-call tensor operation)."""
    rec = active()
    if rec is not None:
        rec.fit = False


class Replay:
    """A recorded call: its allocations, host calls and launches, replayed for new inputs."""

    __slots__ = ("events", "outputs")

    def __init__(self, events, outputs):
        self.events = events
        self.outputs = outputs

    def __call__(self, inputs):
        t = list(inputs)
        for ev in self.events:
            kind = ev[0]
            if kind == "launch" or kind == "op":
                _, fn, grid, template, slots = ev
                args = list(template)
                for pos, i in slots:
                    args[pos] = t[i]
                if kind == "launch":
                    fn(grid, *args)
                else:
                    t.append(fn(*args))
            elif kind == "alloc":
                _, shape, dtype, device, zero = ev
                t.append(torch.zeros(shape, dtype=dtype, device=device) if zero else
                         torch.empty(shape, dtype=dtype, device=device))
            else:
                ev[1](*ev[2])
        return tuple(t[i] for i in self.outputs)


class Refused:
    """A signature that is not replayed, and why (``reason``)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self):
        return f"Refused({self.reason!r})"


def _difference(a, b) -> str | None:
    """Where two recordings' events differ (fixed tensors by identity, everything else by
    equality), or None where they agree."""
    if len(a) != len(b):
        return f"{len(a)} events, then {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if len(x) != len(y) or x[0] != y[0]:
            return f"event {i}: {x[0]}, then {y[0]}"
        for j, (u, w) in enumerate(zip(x[1:], y[1:])):
            if not _equal(u, w):
                what = getattr(getattr(x[1], "fn", x[1]), "__name__", x[0])
                return f"event {i} ({what}), field {j + 1}"
    return None


def _equal(u, w) -> bool:
    if isinstance(u, torch.Tensor) or isinstance(w, torch.Tensor):
        return u is w
    if isinstance(u, tuple) and isinstance(w, tuple):
        return len(u) == len(w) and all(_equal(p, r) for p, r in zip(u, w))
    if callable(u) and not isinstance(u, type):
        return u is w or u == w
    return type(u) is type(w) and u == w


def _memo(layout) -> dict:
    memo = layout.cache.get(_MEMO)
    if memo is None:
        memo = layout.cache[_MEMO] = {}
    return memo


def lookup(layout, key):
    """The memo entry of ``key`` on ``layout``: a :class:`Replay`, a :class:`Refused`, or None (not
    known yet, or recorded once)."""
    memo = layout.cache.get(_MEMO)
    if memo is None:
        return None
    hit = memo.get(key)
    return hit if isinstance(hit, (Replay, Refused)) else None


def settle(layout, key, rec: _Recording, outputs) -> None:
    """File the recording ``rec`` of a call that returned ``outputs`` under ``key``: the first
    recording waits for a second; two that agree make a :class:`Replay`; anything else marks the
    key as not replayable."""
    memo = _memo(layout)
    idx = tuple(rec.ids.get(id(o)) for o in outputs)
    why = ("a per-call operation outside the recorded calls" if not rec.fit else
           "no kernel path vouched for its operations" if not rec.vouched else
           "no recorded launch" if not any(ev[0] == "launch" for ev in rec.events) else
           "an output that is neither an input nor an allocation" if None in idx else None)
    if why is not None:
        memo[key] = Refused(why)
        return
    events = tuple(rec.events)
    prev = memo.get(key)
    if isinstance(prev, tuple):
        diff = _difference(prev[0], events) or (None if prev[1] == idx else "the outputs")
        if diff is None:
            memo[key] = Replay(events, idx)
        elif prev[2] + 1 < _MAX_RECORDINGS:  # wait for two that agree
            memo[key] = (events, idx, prev[2] + 1)
        else:
            memo[key] = Refused(f"consecutive recordings differ: {diff}")
        return
    if prev is None:
        if len(memo) >= _MAX_ENTRIES:
            memo.pop(next(iter(memo)))
        memo[key] = (events, idx, 1)


def clear(layout) -> None:
    """Forget every recorded call of ``layout``."""
    layout.cache.pop(_MEMO, None)
