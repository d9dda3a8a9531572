"""Score modifiers: fused changes of the attention scores beside the mask algebra.

A mask decides *which* scores exist; a score modifier changes the *values* of the kept ones before
the softmax. Two modifiers are fused into the kernels and the PyTorch backend:

* :func:`alibi` (Press et al., "Train Short, Test Long", 2022): ``score += slope[h] * (key_pos -
  query_pos)`` with one slope per query head;
* :func:`softcap` (Gemma 2): ``score = cap * tanh(score / cap)``.

They combine with ``+`` (``alibi(slopes) + softcap(30.0)``). On the PyTorch backend only, a
FlexAttention-style callable :func:`score_fn` ``fn(score, b, h, q_idx, kv_idx)`` may modify the
scores instead (gradients through ``torch.autograd``). Whatever the order of the sum, the
scaled score ``scale * q·k`` first gets the ALiBi bias, then the soft-cap. Positions are those the
mask sees: query row ``i`` sits at ``i + Lk - Lq`` with the default bottom-right alignment (``i``
top-left), and a context-parallel shard uses the global positions of its rows and keys.

A :class:`ScoreMod` is immutable, hashable and serialisable (:meth:`ScoreMod.to_dict`). Its values
(slopes, cap) are run-time arguments of the kernels: changing them compiles nothing new; only
*which* modifiers are present selects a kernel variant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch

__all__ = ["ScoreMod", "alibi", "softcap", "score_fn", "alibi_slopes", "check_score_mod"]

ALIBI = 1
SOFTCAP = 2
CALLABLE = 4


@dataclass(frozen=True)
class ScoreMod:
    """A fused score modifier (build it with :func:`alibi`, :func:`softcap` and ``+``).

    Attributes:
        slopes: ALiBi slopes, one per query head (or one for all heads), or None.
        cap: soft-cap value (``> 0``), or None.
        fn: a :func:`score_fn` callable (PyTorch backend only), or None.
    """

    slopes: tuple | None = None
    cap: float | None = None
    fn: object = None

    @property
    def kind(self) -> int:
        """Bit flags of the modifiers present (1: ALiBi, 2: soft-cap, 4: a callable): the kernels'
        ``SCORE_MOD`` (the kernels take 1 and 2)."""
        return ((ALIBI if self.slopes is not None else 0) | (SOFTCAP if self.cap is not None else 0)
                | (CALLABLE if self.fn is not None else 0))

    def __add__(self, other: "ScoreMod") -> "ScoreMod":
        if not isinstance(other, ScoreMod):
            return NotImplemented
        if (self.fn is not None and other.kind) or (other.fn is not None and self.kind):
            raise ValueError("score_mod: a score_fn() callable does not combine with other modifiers; apply "
                             "the ALiBi bias or the soft-cap inside the callable")
        if self.slopes is not None and other.slopes is not None:
            raise ValueError("score_mod: two alibi() terms in one sum; pass one slope per head to a single alibi()")
        if self.cap is not None and other.cap is not None:
            raise ValueError("score_mod: two softcap() terms in one sum; use one cap")
        return ScoreMod(self.slopes if self.slopes is not None else other.slopes,
                        self.cap if self.cap is not None else other.cap)

    def __str__(self) -> str:
        parts = []
        if self.slopes is not None:
            parts.append(f"alibi({self.slopes[0]!r})" if len(self.slopes) == 1 else f"alibi({list(self.slopes)!r})")
        if self.cap is not None:
            parts.append(f"softcap({self.cap!r})")
        if self.fn is not None:
            parts.append(f"score_fn({getattr(self.fn, '__name__', type(self.fn).__name__)})")
        return " + ".join(parts) or "ScoreMod()"

    def to_dict(self) -> dict:
        """A JSON-serialisable description (:meth:`from_dict` reads it back); callables cannot be
        serialised."""
        if self.fn is not None:
            raise TypeError("ScoreMod.to_dict(): a score_fn() callable cannot be serialised")
        return {"slopes": None if self.slopes is None else list(self.slopes), "cap": self.cap}

    @staticmethod
    def from_dict(d: dict) -> "ScoreMod":
        out = ScoreMod()
        if d.get("slopes") is not None:
            out = out + alibi(torch.tensor(d["slopes"], dtype=torch.float64))
        if d.get("cap") is not None:
            out = out + softcap(d["cap"])
        return out

    # -------------------------------------------------------------------------------------------
    # helpers for the backends
    # -------------------------------------------------------------------------------------------
    def check_heads(self, H: int) -> None:
        """Raise a clear error when the slopes do not fit ``H`` query heads."""
        if self.slopes is not None and len(self.slopes) not in (1, H):
            raise ValueError(f"score_mod: alibi() has {len(self.slopes)} slopes but q has H={H} heads: pass one "
                             f"slope per query head (a 1-D tensor of length {H}) or a single float")

    def slopes_tensor(self, H: int, device, dtype=torch.float32) -> torch.Tensor:
        """The slopes as an ``(H,)`` tensor (zeros without ALiBi)."""
        if self.slopes is None:
            return torch.zeros(H, dtype=dtype, device=device)
        t = torch.tensor(self.slopes, dtype=dtype)
        return (t.expand(H) if len(self.slopes) == 1 else t).contiguous().to(device)

    def apply(self, s: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor, slopes: torch.Tensor | None):
        """``(modified scores, tanh term or None)`` of scaled scores ``s``.

        ``qpos``/``kpos`` broadcast to ``s`` (positions of its rows/columns); ``slopes`` broadcasts
        to ``s`` (per head). The tanh term gives the soft-cap's derivative ``1 - t**2``."""
        if self.slopes is not None:
            s = s + slopes.to(s.dtype) * (kpos - qpos).to(s.dtype)
        t = None
        if self.cap is not None:
            t = torch.tanh(s / self.cap)
            s = self.cap * t
        return s, t


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
        slopes: a float (all heads) or a 1-D floating-point tensor (or sequence) of length ``H``,
            one slope per query head (:func:`alibi_slopes` gives the paper's geometric ones).
            Slopes are constants: they receive no gradient.

    Returns:
        A :class:`ScoreMod`; pass it as ``score_mod=`` to :func:`blocksparse_fa.attention`.
    """
    if isinstance(slopes, torch.Tensor):
        if not slopes.dtype.is_floating_point:
            raise TypeError(f"alibi(slopes): slopes must be a floating-point tensor, got {slopes.dtype}")
        if slopes.device.type == "meta":
            raise ValueError("alibi(slopes): slopes must hold values (a CPU or CUDA tensor), got a meta tensor")
        if slopes.dim() != 1 or slopes.numel() == 0:
            raise ValueError(f"alibi(slopes): slopes must be a 1-D tensor of length H (one per query head), "
                             f"got shape {tuple(slopes.shape)}")
        vals = tuple(float(x) for x in slopes.detach().double().cpu().tolist())
    elif isinstance(slopes, (list, tuple)):
        if not slopes:
            raise ValueError("alibi(slopes): slopes must not be empty")
        vals = tuple(_real("alibi(slopes): each slope", x) for x in slopes)
    else:
        vals = (_real("alibi(slopes): slopes", slopes),)
    if not all(math.isfinite(x) for x in vals):
        raise ValueError(f"alibi(slopes): slopes must be finite, got {vals}")
    return ScoreMod(slopes=vals)


def softcap(cap) -> ScoreMod:
    """Soft-capping (Gemma 2): ``score = cap * tanh(score / cap)`` on the scaled (and ALiBi-biased)
    scores; gradients flow through ``1 - tanh²``.

    Args:
        cap: a positive finite real, e.g. 50.0 (Gemma 2's attention soft-cap).
    """
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
        raise TypeError(f"score_mod must be a ScoreMod (blocksparse_fa.alibi(...), softcap(...), or their sum) "
                        f"or None, got {type(score_mod).__name__}")
    if score_mod.kind == 0:
        return None
    score_mod.check_heads(H)
    return score_mod
