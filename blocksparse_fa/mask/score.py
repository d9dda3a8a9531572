"""Score modifiers: fused changes of the attention scores beside the mask algebra.

A mask decides *which* scores exist; a score modifier changes the *values* of the kept ones before
the softmax. Three modifiers are fused into the kernels and the PyTorch backend:

* :func:`alibi` (Press et al., "Train Short, Test Long", 2022): ``score += slope[h] * (key_pos -
  query_pos)`` with one slope per query head;
* :func:`bias`: ``score += bias[b, h, i, j]``, a tensor broadcastable to ``(B, H, Lq, Lk)``
  (learned relative-position biases, per-head per-key biases, ...);
* :func:`softcap` (Gemma 2): ``score = cap * tanh(score / cap)``.

They combine with ``+`` (``alibi(slopes) + bias(t) + softcap(30.0)``). On the PyTorch backend only,
a FlexAttention-style callable :func:`score_fn` ``fn(score, b, h, q_idx, kv_idx)`` may modify the
scores instead (gradients through ``torch.autograd``). Whatever the order of the sum, the scaled
score ``scale * q·k`` first gets the ALiBi term, then the bias, then the soft-cap. Positions are
those the mask sees: query row ``i`` sits at ``i + Lk - Lq`` with the default bottom-right
alignment (``i`` top-left), and a context-parallel shard uses the global positions of its rows and
keys. The bias is indexed by the row and key *indices* of the tensors passed (``i``, ``j``).

A :class:`ScoreMod` is immutable and hashable; without tensors it is serialisable
(:meth:`ScoreMod.to_dict`). Its values (slopes, cap, bias) are run-time arguments of the kernels:
changing them compiles nothing new; only *which* modifiers are present selects a kernel variant.
Tensors are held by reference (values read at each call) and receive gradients when they require
them: ALiBi slopes and the bias can be learned.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, replace
from numbers import Real

import torch

__all__ = ["ScoreMod", "alibi", "bias", "softcap", "score_fn", "alibi_slopes", "check_score_mod"]

ALIBI = 1
SOFTCAP = 2
CALLABLE = 4
BIAS = 8
# flags of the backward kernels only (``kernel_kind``): which gradients to accumulate, and over which
# broadcast dims of the bias a tile is summed before its atomic add
DBIAS = 16
DSLOPES = 32
BIAS_ROWS_BROADCAST = 64
BIAS_KEYS_BROADCAST = 128


def _ident(x):
    """Tensors compare and hash by identity (they are held by reference), values by value."""
    return ("tensor", id(x)) if isinstance(x, torch.Tensor) else x


def _tensor_repr(t: torch.Tensor) -> str:
    if t.device.type != "meta" and t.numel() <= 16 and not torch.compiler.is_compiling():
        vals = t.detach().double().cpu().reshape(-1).tolist()
        return repr(vals[0]) if t.dim() == 0 else repr(vals)
    return f"tensor(shape={tuple(t.shape)})"


@dataclass(frozen=True, eq=False)
class ScoreMod:
    """A fused score modifier (build it with :func:`alibi`, :func:`bias`, :func:`softcap` and ``+``).

    Attributes:
        slopes: ALiBi slopes, one per query head (or one for all heads): a tuple of floats
            (constants), a 1-D tensor (held by reference; it gets a gradient when it requires one),
            or None.
        cap: soft-cap value (``> 0``): a float, a one-element tensor (held by reference), or None.
        fn: a :func:`score_fn` callable (PyTorch backend only), or None.
        bias: an additive bias tensor broadcastable to ``(B, H, Lq, Lk)``, or None.
    """

    slopes: tuple | torch.Tensor | None = None
    cap: float | torch.Tensor | None = None
    fn: object = None
    bias: torch.Tensor | None = None

    def _key(self):
        return (_ident(self.slopes), _ident(self.cap), self.fn, _ident(self.bias))

    def __eq__(self, other):
        if not isinstance(other, ScoreMod):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    @property
    def kind(self) -> int:
        """Bit flags of the modifiers present (1: ALiBi, 2: soft-cap, 4: a callable, 8: a bias):
        the kernels' ``SCORE_MOD`` (the kernels take 1, 2 and 8)."""
        return ((ALIBI if self.slopes is not None else 0) | (SOFTCAP if self.cap is not None else 0)
                | (CALLABLE if self.fn is not None else 0) | (BIAS if self.bias is not None else 0))

    @property
    def tensors(self) -> tuple:
        """``(slopes, bias)``: the tensors that can receive gradients (None where absent or constant)."""
        return (self.slopes if isinstance(self.slopes, torch.Tensor) else None), self.bias

    def __add__(self, other: "ScoreMod") -> "ScoreMod":
        if not isinstance(other, ScoreMod):
            return NotImplemented
        if (self.fn is not None and other.kind) or (other.fn is not None and self.kind):
            raise ValueError("score_mod: a score_fn() callable does not combine with other modifiers; apply "
                             "the ALiBi term, the bias or the soft-cap inside the callable")
        if self.slopes is not None and other.slopes is not None:
            raise ValueError("score_mod: two alibi() terms in one sum; pass one slope per head to a single alibi()")
        if self.cap is not None and other.cap is not None:
            raise ValueError("score_mod: two softcap() terms in one sum; use one cap")
        if self.bias is not None and other.bias is not None:
            raise ValueError("score_mod: two bias() terms in one sum; add the tensors and pass one bias()")
        pick = lambda a, b: a if a is not None else b  # noqa: E731
        return ScoreMod(pick(self.slopes, other.slopes), pick(self.cap, other.cap), None, pick(self.bias, other.bias))

    def __str__(self) -> str:
        parts = []
        if self.slopes is not None:
            if isinstance(self.slopes, torch.Tensor):
                parts.append(f"alibi({_tensor_repr(self.slopes)})")
            else:
                parts.append(f"alibi({self.slopes[0]!r})" if len(self.slopes) == 1 else f"alibi({list(self.slopes)!r})")
        if self.bias is not None:
            parts.append(f"bias(tensor(shape={tuple(self.bias.shape)}))")
        if self.cap is not None:
            parts.append(f"softcap({_tensor_repr(self.cap) if isinstance(self.cap, torch.Tensor) else repr(self.cap)})")
        if self.fn is not None:
            parts.append(f"score_fn({getattr(self.fn, '__name__', type(self.fn).__name__)})")
        return " + ".join(parts) or "ScoreMod()"

    __repr__ = __str__

    def to_dict(self) -> dict:
        """A JSON-serialisable description (:meth:`from_dict` reads it back; slopes given as a
        tensor come back as constants); callables and bias tensors cannot be serialised."""
        if self.fn is not None:
            raise TypeError("ScoreMod.to_dict(): a score_fn() callable cannot be serialised")
        if self.bias is not None:
            raise TypeError("ScoreMod.to_dict(): a bias() tensor cannot be serialised (save the tensor itself)")
        slopes, cap = self.slopes, self.cap
        if isinstance(slopes, torch.Tensor):
            slopes = slopes.detach().double().cpu().reshape(-1).tolist()
        if isinstance(cap, torch.Tensor):
            cap = float(cap.detach().double().cpu().reshape(-1)[0])
        return {"slopes": None if slopes is None else list(slopes), "cap": cap}

    @staticmethod
    def from_dict(d: dict) -> "ScoreMod":
        out = ScoreMod()
        if d.get("slopes") is not None:
            out = out + alibi(list(d["slopes"]))
        if d.get("cap") is not None:
            out = out + softcap(d["cap"])
        return out

    # -------------------------------------------------------------------------------------------
    # helpers for the backends
    # -------------------------------------------------------------------------------------------
    def n_slopes(self) -> int:
        s = self.slopes
        return 0 if s is None else (s.numel() if isinstance(s, torch.Tensor) else len(s))

    def check_heads(self, H: int) -> None:
        """Raise a clear error when the slopes do not fit ``H`` query heads."""
        n = self.n_slopes()
        if self.slopes is not None and n not in (1, H):
            raise ValueError(f"score_mod: alibi() has {n} slopes but q has H={H} heads: pass one "
                             f"slope per query head (a 1-D tensor of length {H}) or a single float")

    def slopes_tensor(self, H: int, device, dtype=torch.float32) -> torch.Tensor:
        """The slopes as an ``(H,)`` tensor (zeros without ALiBi); differentiable with respect to a
        slopes tensor."""
        if self.slopes is None:
            return torch.zeros(H, dtype=dtype, device=device)
        if isinstance(self.slopes, torch.Tensor):
            t = self.slopes.to(device=device, dtype=dtype)
            return t.expand(H) if t.numel() == 1 else t
        t = torch.tensor(self.slopes, dtype=dtype)
        return (t.expand(H) if len(self.slopes) == 1 else t).contiguous().to(device)

    def apply(self, s: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor, slopes: torch.Tensor | None,
              bias: torch.Tensor | None = None):
        """``(modified scores, tanh term or None)`` of scaled scores ``s``.

        ``qpos``/``kpos`` broadcast to ``s`` (positions of its rows/columns); ``slopes`` broadcasts
        to ``s`` (per head); ``bias`` (the bias values of these scores) too. The tanh term gives the
        soft-cap's derivative ``1 - t**2``."""
        if self.slopes is not None:
            s = s + slopes.to(s.dtype) * (kpos - qpos).to(s.dtype)
        if self.bias is not None:
            s = s + bias.to(s.dtype)
        t = None
        if self.cap is not None:
            cap = self.cap.detach().to(s.dtype) if isinstance(self.cap, torch.Tensor) else self.cap
            t = torch.tanh(s / cap)
            s = cap * t
        return s, t

    def bind(self, lead: tuple, H: int, Lq: int, Lk: int, device) -> "ScoreMod":
        """This modifier for one call on inputs ``(*lead, H, Lq, D)`` flattened to ``(B, H, Lq, D)``:
        a slopes tensor moved to ``device`` and expanded to ``(H,)``, the bias checked against
        ``(*lead, H, Lq, Lk)`` and viewed as 4-D ``(1 or B, 1 or H, 1 or Lq, 1 or Lk)`` (size-1 dims
        broadcast; the leading dims flattened like the inputs'). Differentiable: gradients of the
        bound tensors reach the tensors given."""
        self.check_heads(H)
        out = self
        if isinstance(self.slopes, torch.Tensor):
            t = self.slopes
            if t.device != torch.device(device) and t.device.type == "meta":
                raise ValueError(f"score_mod: alibi() slopes are a meta tensor but the inputs are on {device}")
            t = device_copy(t, device)
            out = replace(out, slopes=t.expand(H) if t.numel() == 1 else t)
        if self.bias is not None:
            out = replace(out, bias=_bias4(self.bias, tuple(lead), H, Lq, Lk, device))
        return out


_COPIES: "collections.OrderedDict" = collections.OrderedDict()  # (id, version, device) -> (tensor, device copy)


def device_copy(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``. A constant host tensor (no grad, eager) is copied once per version and the
    copy kept: repeated calls, and CUDA graph captures after a first call, copy nothing."""
    device = torch.device(device)
    if t.device == device or t.requires_grad or t.device.type != "cpu" or torch.compiler.is_compiling() \
            or t.is_inference():
        return t.to(device)
    key = (id(t), t._version, str(device))
    hit = _COPIES.get(key)
    if hit is not None and hit[0] is t:
        _COPIES.move_to_end(key)
        return hit[1]
    copy = t.to(device)
    _COPIES[key] = (t, copy)
    while len(_COPIES) > 64:
        _COPIES.popitem(last=False)
    return copy


def _bias4(t: torch.Tensor, lead: tuple, H: int, Lq: int, Lk: int, device) -> torch.Tensor:
    full = (*lead, H, Lq, Lk)
    if t.device != torch.device(device):
        raise ValueError(f"score_mod: the bias() tensor is on {t.device} but q is on {device}: move it to q's device")
    try:
        shape = torch.broadcast_shapes(tuple(t.shape), full)
    except RuntimeError:
        shape = None
    if shape != full:
        raise ValueError(f"score_mod: the bias() tensor of shape {tuple(t.shape)} does not broadcast to "
                         f"(..., H, Lq, Lk) = {full} (dims of size 1 broadcast; e.g. (1, H, 1, Lk) per head and "
                         f"key, (H, Lq, Lk) per head and position)")
    t = t.reshape((1,) * (len(full) - t.dim()) + tuple(t.shape))
    for d in range(t.dim()):  # an expanded dim (stride 0) is a broadcast one: read (and sum the gradient) once
        if t.shape[d] > 1 and t.stride(d) == 0:
            t = t.narrow(d, 0, 1)
    nb = len(lead)
    tail = tuple(t.shape[nb:])
    if all(n == 1 for n in t.shape[:nb]):
        return t.reshape(1, *tail)
    return t.expand(*lead, *tail).reshape(-1, *tail)


def call_fn(fn, s: torch.Tensor, b, h, q_idx, kv_idx) -> torch.Tensor:
    """``fn(s, b, h, q_idx, kv_idx)`` checked: a floating tensor of ``s``'s shape."""
    out = fn(s, b, h, q_idx, kv_idx)
    if not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point:
        raise TypeError(f"score_mod: the score_fn() callable must return a floating-point tensor, "
                        f"got {type(out).__name__ if not isinstance(out, torch.Tensor) else out.dtype}")
    if out.shape != s.shape:
        try:
            out = torch.broadcast_to(out, s.shape)
        except RuntimeError:
            raise ValueError(f"score_mod: the score_fn() callable returned shape {tuple(out.shape)} for scores of "
                             f"shape {tuple(s.shape)}; it must work elementwise on broadcast index tensors") from None
    return out.to(s.dtype)


def _real(name: str, x) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a real scalar, got a tensor of shape {tuple(x.shape)}")
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}")
    return float(x)


def alibi(slopes) -> ScoreMod:
    """ALiBi: add ``slopes[h] * (key_pos - query_pos)`` to the scaled scores of query head ``h``.

    Args:
        slopes: a float (all heads), a sequence of ``H`` floats (constants), or a 1-D
            floating-point tensor of length ``H`` (or 1) held by reference: its values are read at
            each call (changing them compiles nothing new, also under ``torch.compile``), and it
            receives a gradient when it requires one (learned slopes, e.g. an ``nn.Parameter``).
            :func:`alibi_slopes` gives the paper's geometric slopes.

    Returns:
        A :class:`ScoreMod`; pass it as ``score_mod=`` to :func:`blocksparse_fa.attention`.
    """
    if isinstance(slopes, torch.Tensor):
        if not slopes.dtype.is_floating_point:
            raise TypeError(f"alibi(slopes): slopes must be a floating-point tensor, got {slopes.dtype}")
        if slopes.dim() != 1 or slopes.numel() == 0:
            raise ValueError(f"alibi(slopes): slopes must be a 1-D tensor of length H (one per query head), "
                             f"got shape {tuple(slopes.shape)}")
        return ScoreMod(slopes=slopes)
    if isinstance(slopes, (list, tuple)):
        if not slopes:
            raise ValueError("alibi(slopes): slopes must not be empty")
        vals = tuple(_real("alibi(slopes): each slope", x) for x in slopes)
    else:
        vals = (_real("alibi(slopes): slopes", slopes),)
    if not all(math.isfinite(x) for x in vals):
        raise ValueError(f"alibi(slopes): slopes must be finite, got {vals}")
    return ScoreMod(slopes=vals)


def bias(tensor) -> ScoreMod:
    """An additive bias: ``score += tensor[b, h, i, j]`` (after the scale and the ALiBi term, before
    the soft-cap), broadcast as in SDPA.

    Args:
        tensor: a floating-point tensor broadcastable to ``(B, H, Lq, Lk)`` (for inputs with other
            leading dims, to ``(*batch, H, Lq, Lk)``), on the inputs' device: e.g. ``(1, H, 1, Lk)``
            per head and key, ``(H, Lq, Lk)`` a relative-position bias materialised per head,
            ``(B, 1, 1, Lk)`` per sequence and key. ``i``/``j`` index the rows and keys of the
            tensors passed. It is held by reference (values read at each call: a new tensor of the
            same shape and dtype compiles nothing new) and receives a gradient when it requires one:
            ``dBias = ∂loss/∂(scale·q·k + ALiBi + bias)``, the softmax gradient dS times the
            soft-cap's derivative ``1 - tanh²`` when there is one, summed over the broadcast dims.

    Only the blocks the mask visits read the bias; masked elements never do in a way that reaches
    the result: a ``-inf`` or NaN there is harmless. A ``-inf`` at a kept element removes that key
    (without a soft-cap, which maps ``-inf`` to ``-cap``); use a mask to remove keys, it also skips
    their blocks. On the Triton kernels the gradient is accumulated in float32 with atomic adds,
    so where the bias is broadcast over batch or heads (several programs add to one element) it is
    not bit-reproducible between runs; the other gradients stay deterministic.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"bias(tensor): tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"bias(tensor): tensor must be floating-point, got {tensor.dtype}")
    if tensor.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"bias(tensor): supported dtypes are float16, bfloat16, float32 and float64, got {tensor.dtype}")
    return ScoreMod(bias=tensor)


def softcap(cap) -> ScoreMod:
    """Soft-capping (Gemma 2): ``score = cap * tanh(score / cap)`` on the scaled (ALiBi- and
    bias-modified) scores; gradients flow through ``1 - tanh²``.

    Args:
        cap: a positive finite real, e.g. 50.0 (Gemma 2's attention soft-cap), or a one-element
            floating-point tensor (held by reference: its value is read at each call; it gets no
            gradient). Under ``torch.compile`` a new float value recompiles once, after which
            Dynamo treats it as dynamic; a tensor never recompiles.
    """
    if isinstance(cap, torch.Tensor):
        if not cap.dtype.is_floating_point or cap.numel() != 1:
            raise ValueError(f"softcap(cap): a tensor cap must be one floating-point element, got shape "
                             f"{tuple(cap.shape)} and dtype {cap.dtype}")
        if cap.device.type == "cpu" and not torch.compiler.is_compiling():
            c = float(cap.detach().reshape(-1)[0])
            if not (math.isfinite(c) and c > 0):
                raise ValueError(f"softcap(cap): cap must be a positive finite number, got {c!r}")
        return ScoreMod(cap=cap)
    if torch.compiler.is_compiling() and isinstance(cap, (float, int)) and not isinstance(cap, bool):
        return ScoreMod(cap=cap)  # Dynamo may trace it as a dynamic float: no Python checks on its value
    c = _real("softcap(cap): cap", cap)
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"softcap(cap): cap must be a positive finite number, got {cap!r}")
    return ScoreMod(cap=c)


def score_fn(fn) -> ScoreMod:
    """A FlexAttention-style score modifier ``fn(score, b, h, q_idx, kv_idx) -> score`` (PyTorch
    backend only: ``backend="torch"``, or ``"auto"`` on CPU; the Triton kernels raise
    ``NotImplementedError``).

    ``fn`` is called on blocks of scaled scores ``(b, h, rows, keys)`` with broadcastable int64
    index tensors: ``b`` ``(b, 1, 1, 1)``, ``h`` ``(1, h, 1, 1)`` (query heads), ``q_idx`` ``(rows, 1)``
    (the query *row* index, as in FlexAttention, not the aligned position) and ``kv_idx``
    ``(1, keys)``; it must be elementwise and written with torch operations (no Python branching
    on values). Gradients reach q, k and v through ``torch.autograd``; tensors the callable closes
    over get none. Objects compare and hash by the callable's identity.
    """
    if not callable(fn) or isinstance(fn, torch.Tensor):
        raise TypeError(f"score_fn(fn): fn must be a callable fn(score, b, h, q_idx, kv_idx), got {type(fn).__name__}")
    return ScoreMod(fn=fn)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """The ALiBi paper's slopes ``2**(-8 i / n)`` for ``i = 1..n`` (``n`` a power of two; otherwise
    the paper's interleaving of the next power of two), float32 ``(n_heads,)``."""
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"alibi_slopes(n_heads): n_heads must be a positive int, got {n_heads!r}")

    def pow2(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    p = 2 ** int(math.floor(math.log2(n_heads)))
    vals = pow2(p) if p == n_heads else pow2(p) + pow2(2 * p)[0::2][: n_heads - p]
    return torch.tensor(vals, dtype=torch.float32)


def check_score_mod(score_mod, H: int) -> ScoreMod | None:
    """``score_mod`` validated for ``H`` query heads (None, or a ScoreMod with no term, gives None)."""
    if score_mod is None:
        return None
    if not isinstance(score_mod, ScoreMod):
        raise TypeError(f"score_mod must be a ScoreMod (blocksparse_fa.alibi(...), bias(...), softcap(...), or a sum) "
                        f"or None, got {type(score_mod).__name__}")
    if score_mod.kind == 0:
        return None
    score_mod.check_heads(H)
    return score_mod
