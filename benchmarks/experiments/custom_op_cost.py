"""Host cost of ``torch.library`` custom-op dispatch against an ``autograd.Function`` (CUDA).

Empty bodies (``empty_like``), so what is timed is the dispatch alone: a custom op with registered
autograd (forward with grad, forward under no_grad, forward+backward), the same call through
``torch.ops``, a raw ``torch.library.Library`` kernel, the plain Python body, an
``autograd.Function`` and, for scale, ``torch.cuda.current_stream()`` and ``torch.empty_like``.
Microseconds per call, 3,000 calls after 100 warm-ups.

    PYTHONPATH=. python benchmarks/experiments/custom_op_cost.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_path import host_us  # noqa: E402


def _body(x):
    return torch.empty_like(x), x.new_empty(x.shape[:-1])


@torch.library.custom_op("bsfa_probe::fwd", mutates_args=())
def fwd(x: torch.Tensor, s: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _body(x)


@fwd.register_fake
def _fwd_fake(x, s):
    return _body(x)


@torch.library.custom_op("bsfa_probe::bwd", mutates_args=())
def bwd(g: torch.Tensor, s: str) -> torch.Tensor:
    return torch.empty_like(g)


@bwd.register_fake
def _bwd_fake(g, s):
    return torch.empty_like(g)


def _setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)


def _backward(ctx, go, glse):
    return bwd(go, "a"), None


fwd.register_autograd(_backward, setup_context=_setup)

_LIB = torch.library.Library("bsfa_probe_raw", "DEF")
_LIB.define("fwd(Tensor x, str s) -> (Tensor, Tensor)")
_LIB.impl("fwd", lambda x, s: _body(x), "CUDA")


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s):
        ctx.set_materialize_grads(False)
        return _body(x)

    @staticmethod
    def backward(ctx, go, glse):
        return torch.empty_like(go), None


def per_call_us(fn) -> float:
    for _ in range(100):
        fn()
    return host_us(fn, 3000)


def main():
    x = torch.randn(4, 4, device="cuda", requires_grad=True)
    go = torch.randn(4, 4, device="cuda")
    rows = [("custom op forward (grad)", lambda: fwd(x, "a")),
            ("autograd.Function forward", lambda: _Fn.apply(x, "a")),
            ("custom op forward+backward", lambda: torch.autograd.grad(fwd(x, "a")[0], x, go)),
            ("autograd.Function forward+backward", lambda: torch.autograd.grad(_Fn.apply(x, "a")[0], x, go))]
    for name, fn in rows:
        print(f"{name:40s} {per_call_us(fn):8.1f} us")
    with torch.no_grad():
        for name, fn in (("custom op forward (no grad)", lambda: fwd(x, "a")),
                         ("torch.ops custom op (no grad)", lambda: torch.ops.bsfa_probe.fwd(x, "a")),
                         ("raw Library kernel (no grad)", lambda: torch.ops.bsfa_probe_raw.fwd(x, "a")),
                         ("plain Python body", lambda: _body(x)),
                         ("torch.cuda.current_stream()", torch.cuda.current_stream),
                         ("torch.empty_like", lambda: torch.empty_like(x))):
            print(f"{name:40s} {per_call_us(fn):8.1f} us")


if __name__ == "__main__":
    main()
