"""``torch.library`` operators without :func:`torch.library.custom_op`'s per-call wrappers.

The package's operators (attention, the device intervals' tables, context parallelism) are opaque
calls of a compiled graph. :func:`torch.library.custom_op` would define them in one line, but every
call of such an operator also runs Python wrappers (the backend dispatch table, the output aliasing
check, a ``torch._dynamo.disable`` frame): on a 2-core CPU with empty bodies, a compiled
forward+backward through a ``custom_op`` pair took 233 µs against 182 µs through the same pair
defined as below (``benchmarks/NOTES.md``, section 12). A compiled training step pays this once per
attention call, so :func:`custom_op` here keeps ``custom_op``'s interface (schema inferred from the
annotations, ``register_fake``, ``register_autograd``) and registers the body directly as the
operator's ``CompositeExplicitAutograd`` kernel of a :class:`torch.library.Library` fragment.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["custom_op", "Operator"]

_LIBS: dict = {}  # namespace -> Library fragment (kept alive: a collected Library drops its registrations)


def _library(namespace: str) -> torch.library.Library:
    lib = _LIBS.get(namespace)
    if lib is None:
        lib = _LIBS[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return lib


class Operator:
    """An operator ``namespace::name`` whose kernel is ``fn`` (for every device) and whose schema is
    inferred from ``fn``'s annotations. Calling the object calls the operator (``.default``, the
    :class:`torch._ops.OpOverload`, is what :func:`torch.library.opcheck` takes)."""

    def __init__(self, qualname: str, fn, mutates_args=()):
        if not isinstance(qualname, str) or qualname.count("::") != 1:
            raise ValueError(f"qualname must be 'namespace::name', got {qualname!r}")
        self.namespace, self.name = qualname.split("::")
        self.qualname = qualname
        lib = _library(self.namespace)
        lib.define(self.name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        lib.impl(self.name, fn, "CompositeExplicitAutograd")
        self.default = getattr(getattr(torch.ops, self.namespace), self.name).default
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return self.default(*args, **kwargs)

    def register_fake(self, fn):
        """Register ``fn`` as the shapes-only implementation (fake and meta tensors); returns ``fn``."""
        torch.library.register_fake(self.qualname, fn, lib=_library(self.namespace))
        return fn

    def register_autograd(self, backward, *, setup_context=None) -> None:
        """Register ``backward(ctx, *grads)`` with ``setup_context(ctx, inputs, output)``, as
        :func:`torch.library.register_autograd`."""
        torch.library.register_autograd(self.qualname, backward, setup_context=setup_context,
                                        lib=_library(self.namespace))


def custom_op(qualname: str, *, mutates_args=()):
    """Decorator: ``fn`` as the :class:`Operator` ``qualname`` (``"namespace::name"``)."""
    return lambda fn: Operator(qualname, fn, mutates_args)
