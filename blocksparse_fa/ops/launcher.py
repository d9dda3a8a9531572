"""Kernel launches without Triton's Python launch path on repeat calls.

``kernel[grid](*args, **constexprs)`` binds every argument, derives the specialisation of each (on
every call), hashes a cache key and looks up the compiled variant; with our kernels' 40-80
arguments that costs tens of microseconds per launch on the host, more than some of the kernels
take on the GPU. :class:`Launch` goes through that path once per *specialisation* (the dtypes and
16-byte alignment of the tensor arguments, and for integer arguments whether they are 1, multiples
of 16, or beyond int32: exactly what selects a compiled variant), records the compiled kernel's
low-level launcher and the argument tail Triton appends (constexprs, defaults), and afterwards
calls that launcher directly. Anything else (the interpreter, launch hooks set by a profiler)
takes Triton's own path.
"""

from __future__ import annotations

import os

import torch

from .call_memo import note_launch

__all__ = ["Launch"]

_INT32 = 2**31


def _spec(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return (a == 1, a % 16 == 0, -_INT32 <= a < _INT32)
    if isinstance(a, float):
        return "f"
    return (type(a), a)


def _hooks_active(hook) -> bool:
    """Whether a launch hook would run (a profiler is attached): then Triton's path is taken, since
    the hook reads per-launch metadata. Triton 3.6 passes a ``HookChain`` (empty: inactive)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def _raw_stream(index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(index)


class _Record:
    __slots__ = ("run", "function", "metadata", "hooks", "tail")

    def __init__(self, run, function, metadata, hooks, tail):
        self.run, self.function, self.metadata, self.hooks, self.tail = run, function, metadata, hooks, tail


class Launch:
    """One kernel with fixed constexprs (a launch plan's), launched many times.

    ``n_key``: how many leading arguments can change between calls in a way that selects another
    compiled variant (the per-call tensors and their strides); the rest are fixed by the plan or not
    specialised on (floats, ``do_not_specialize`` ints such as dropout seeds). The direct path keys
    on those leading arguments only: tensors by dtype and 16-byte alignment, ints by value."""

    __slots__ = ("fn", "consts", "records", "enabled", "n_key", "device")

    def __init__(self, fn, consts: dict, n_key: int, device: torch.device):
        self.fn = fn
        self.consts = consts
        self.records: dict = {}
        self.n_key = n_key
        self.device = device
        self.enabled = (os.environ.get("TRITON_INTERPRET", "0") != "1" and hasattr(fn, "warmup")
                        and device.type == "cuda")

    def __call__(self, grid, *args):
        note_launch(self, grid, args)  # an active recording of the call keeps it (ops/call_memo.py)
        self._go(grid, args)

    def _go(self, grid, args):
        if not self.enabled:
            return self.fn[grid](*args, **self.consts)
        key = tuple(a if type(a) is int else (a.data_ptr() & 15, a.dtype) for a in args[:self.n_key])
        rec = self.records.get(key)
        if rec is None or _hooks_active(rec.hooks[1]) or _hooks_active(rec.hooks[2]):
            return self._first(key, grid, args) if rec is None else self.fn[grid](*args, **self.consts)
        md, enter, exit_ = rec.hooks
        g = tuple(grid) + (1, 1)
        rec.run(g[0], g[1], g[2], _raw_stream(self.device.index), rec.function, rec.metadata, md, enter, exit_,
                *args, *rec.tail)

    def _first(self, key, grid, args):
        """Launch through Triton and record how it called the compiled kernel's launcher."""
        ck = self.fn.warmup(*args, grid=grid, **self.consts)
        if ck is None or not hasattr(ck, "run"):
            self.enabled = False
            return self.fn[grid](*args, **self.consts)
        launcher = ck.run
        seen = []

        def record(*a):
            seen.append(a)
            return launcher(*a)

        cls = type(ck)
        prop = cls.__dict__.get("run")
        if isinstance(prop, property):  # triton 3.6: a lazily initialised property of the class
            cls.run = property(lambda obj: record if obj is ck else prop.__get__(obj))
        else:  # an instance attribute
            ck.run = record
        try:
            self.fn[grid](*args, **self.consts)
        finally:
            if isinstance(prop, property):
                cls.run = prop
            else:
                ck.run = launcher
        if len(seen) != 1:
            return
        a = seen[0]
        n = len(args)
        same = len(a) >= 9 + n and all(x is y or (not isinstance(x, torch.Tensor) and x == y)
                                       for x, y in zip(a[9:9 + n], args))
        # the first n_key arguments' specialisation must match what Triton saw (it is in the key)
        same = same and all(_spec(x) == _spec(y) for x, y in zip(a[9:9 + self.n_key], args))
        if same and not _hooks_active(a[7]) and not _hooks_active(a[8]):
            self.records[key] = _Record(launcher, a[4], a[5], (a[6], a[7], a[8]), tuple(a[9 + n:]))
