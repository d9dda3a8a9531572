"""Collectives of context parallelism (torch.distributed), and the checks that keep bad input from
hanging a job: every rank validates its arguments, all ranks exchange the results in one small
all-gather, and if any rank is wrong every rank raises the same error."""

from __future__ import annotations

import os
import struct

import torch
import torch.distributed as dist

from ..compiler.cache import LRUCache

__all__ = ["resolve_group", "init_group", "all_to_all", "exchange", "check_call", "Pending"]


def resolve_group(group):
    """A process group from ``None`` (the default group), a ProcessGroup, a 1-D DeviceMesh, or a
    group name (what the custom op carries)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context parallelism needs torch.distributed initialised (init_process_group)")
    if group is None:
        return dist.group.WORLD
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group)
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - old torch
        DeviceMesh = ()
    if DeviceMesh and isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"a DeviceMesh for context parallelism must be 1-D (pass mesh['cp']), got {group.ndim}-D "
                             f"mesh {tuple(group.mesh_dim_names or ())}")
        return group.get_group()
    return group


_READY: set = set()


def init_group(pg, device) -> None:
    """One collective on a group before its first point-to-point messages: NCCL creates the
    communicator in a collective that every rank joins (the call checks, ``check=True``, are one)."""
    key = (getattr(pg, "group_name", id(pg)), str(device))
    if key not in _READY:
        dist.all_reduce(torch.zeros(1, device=device), group=pg)
        _READY.add(key)


class Pending:
    """A received tensor whose messages may still be in flight (``wait()`` returns it; ``then``:
    work queued after the messages, such as copies out of a staging buffer)."""

    __slots__ = ("tensor", "works", "then")

    def __init__(self, tensor, works=(), then=None):
        self.tensor, self.works, self.then = tensor, list(works) if works else [], then

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        self.works = []
        if self.then is not None:
            self.then()
            self.then = None
        return self.tensor


def all_to_all(x: torch.Tensor, send_splits, recv_splits, group, async_op: bool = False) -> Pending:
    """Rows of ``x`` (dim 0, peer-major with ``send_splits`` rows per peer) to their peers; returns
    the received rows (``recv_splits`` per peer, peer-major)."""
    x = x.contiguous()
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x, list(recv_splits), list(send_splits), group=group, async_op=async_op)
    return Pending(out, [work] if async_op else ())


# How a step of messages travels: ``"p2p"`` (default), one group of NCCL point-to-point sends and
# receives (ranks without messages in the step take no part); ``"all_to_all"``, one
# ``all_to_all_single`` over the group on bytes packed per peer (every rank takes part in every
# step, which the context-parallel calls guarantee: each step is reached by all ranks in the same
# order). The collective takes less host time per step (74-79 against 134-165 us on 4 x H100,
# ``benchmarks/experiments/cp_profile.py p2p``), but the calls are not bound by the host (a CUDA
# graph replay of them is no faster than the eager call), and interleaved on the same inputs the two
# ran within noise of each other, p2p ahead on BigBird (5.53 against 5.85 ms fwd+bwd at 256K;
# ``benchmarks/experiments/cp_graphs.py``). The environment variable ``BSFA_CP_MESSAGES`` selects
# the transport (read at import, the same on every rank).
MESSAGES = os.environ.get("BSFA_CP_MESSAGES", "p2p")
if MESSAGES not in ("p2p", "all_to_all"):
    raise ValueError(f"BSFA_CP_MESSAGES must be 'p2p' or 'all_to_all', got {MESSAGES!r}")


def exchange(sends, recvs, group, ranks, async_op: bool = False, result=None) -> Pending:
    """Messages of one step in one batch (:data:`MESSAGES`: point-to-point, or one all-to-all).

    Args:
        sends, recvs: ``[(peer, tensor, tag)]``: contiguous tensors to send to / receive into, ``peer``
            the rank in ``group``. Both sides list the messages of a pair in the same order; ``tag``
            tells concurrent steps apart where the transport matches by tag (gloo).
        ranks: global rank of each group member (what the messages address).
        async_op: return before the messages complete (``wait()`` on the result).
        result: what ``wait()`` returns.
    """
    if MESSAGES == "all_to_all":
        return _exchange_all_to_all(sends, recvs, group, async_op, result)
    ops = [dist.P2POp(dist.isend, t, ranks[p], group, tag) for p, t, tag in sends if t.numel()]
    ops += [dist.P2POp(dist.irecv, t, ranks[p], group, tag) for p, t, tag in recvs if t.numel()]
    works = dist.batch_isend_irecv(ops) if ops else []
    pending = Pending(result, works)
    if not async_op:
        pending.wait()
    return pending


def _exchange_all_to_all(sends, recvs, group, async_op: bool, result) -> Pending:
    """:func:`exchange` as one ``all_to_all_single`` on bytes: each peer's messages concatenated in
    list order (every rank calls it, with or without messages)."""
    world = dist.get_world_size(group)
    ts = [t for _, t, _ in sends] + [t for _, t, _ in recvs]
    if ts:
        dev = ts[0].device
    elif dist.get_backend(group) == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")

    def flat(t):
        return t.view(-1).view(torch.uint8)

    out_parts, send_splits, recv_splits, into = [], [0] * world, [0] * world, [[] for _ in range(world)]
    for p, t, _ in sends:
        if t.numel():
            send_splits[p] += t.numel() * t.element_size()
    for p in range(world):
        out_parts += [flat(t) for q, t, _ in sends if q == p and t.numel()]
    for p, t, _ in recvs:
        if t.numel():
            recv_splits[p] += t.numel() * t.element_size()
            into[p].append(t)
    send = torch.cat(out_parts) if out_parts else torch.empty(0, dtype=torch.uint8, device=dev)
    recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=dev)
    work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=True)

    def unpack():
        off = 0
        for p in range(world):
            for t in into[p]:
                n = t.numel() * t.element_size()
                flat(t).copy_(recv[off:off + n])
                off += n

    pending = Pending(result, [work], then=unpack)
    if not async_op:
        pending.wait()
    return pending


# ------------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------------
_DTYPES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_FIELDS = ("magic", "fingerprint", "world", "length", "B", "H", "Hkv", "D", "dtype", "scale", "dropout", "seed",
           "error")
_MAGIC = 0x6273666163


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


_CHECKED = LRUCache(256)  # configurations whose check passed ("first")


def check_mode(check) -> str:
    """``"always"``, ``"never"`` or ``"first"`` for the ``check`` argument (True, False, "first"; the
    compiled op passes the names themselves)."""
    if isinstance(check, bool):
        return "always" if check else "never"
    if isinstance(check, str) and check in ("always", "never", "first"):
        return check
    raise ValueError(f"check must be True, False or 'first', got {check!r}")


def _config(group, plan, q, k, v, scale, dropout_p):
    """What a ``"first"`` check is keyed on: the group, the plan, this rank's tensors' shapes,
    dtypes and device, the scale and the dropout as given; None where one of them is not what a
    valid call passes (the call then checks)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or plan is None or \
            not all(x is None or isinstance(x, (int, float)) for x in (scale, dropout_p)):
        return None
    name = getattr(group, "group_name", None) or id(group)
    return (name, plan.fingerprint, plan.world_size, tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype,
            k.dtype, v.dtype, str(q.device), scale, dropout_p)


def needs_check(mode: str, group, plan, q, k, v, scale, dropout_p, seeded: bool) -> bool:
    """Whether this call exchanges its description: always, never, or (``"first"``) where this
    configuration (:func:`_config`) was not checked yet in this process, or where dropout draws
    its seed on rank 0 (every call then exchanges it)."""
    if mode != "first":
        return mode == "always"
    key = _config(group, plan, q, k, v, scale, dropout_p)
    return key is None or (bool(dropout_p) and not seeded) or _CHECKED.get(key) is None


def checked(group, plan, q, k, v, scale, dropout_p) -> None:
    """Records a configuration whose check passed (``"first"``)."""
    key = _config(group, plan, q, k, v, scale, dropout_p)
    if key is not None:
        _CHECKED.put(key, True)


def check_call(group, plan, rank: int, world: int, q, k, v, scale: float, dropout_p: float, seed: int,
               local_error: str | None, device) -> int:
    """Exchange the call's description with every rank; raise the same ``ValueError`` on every rank
    if any rank's call differs or failed its local checks. Returns rank 0's dropout seed (so that
    ranks drawing seeds independently still drop the same elements)."""
    ok4 = all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v))
    B, H, L, D = q.shape if ok4 else (0, 0, 0, 0)
    Hkv = k.shape[1] if ok4 else 0
    dt = _DTYPES.get(q.dtype, 0) if ok4 else 0
    mine = [_MAGIC, plan.fingerprint, plan.world_size, L, B, H, Hkv, D, dt, _bits(scale), _bits(dropout_p), seed,
            1 if local_error else 0]
    t = torch.tensor(mine, dtype=torch.int64, device=device)
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t, group=group)
    rows = [p.cpu().tolist() for p in parts]
    problems = []
    for r, row in enumerate(rows):
        d = dict(zip(_FIELDS, row))
        if d["magic"] != _MAGIC:
            problems.append(f"rank {r} is not in a context-parallel attention call (another collective is pending)")
            continue
        if d["error"]:
            problems.append(f"rank {r} failed its own checks" + (f" ({local_error})" if r == rank else
                                                                   " (its error names the argument)"))
            continue
        if d["world"] != world:
            problems.append(f"rank {r} passed a plan made for {d['world']} ranks; the group has {world}")
        elif d["fingerprint"] != rows[0][1]:
            problems.append(f"rank {r} passed a different plan than rank 0 (mask, length, world size or strategy differ)")
        elif d["length"] != plan.local_len(r) and d["world"] == plan.world_size:
            problems.append(f"rank {r} passed {d['length']} tokens; the plan gives it {plan.local_len(r)} (shard inputs "
                            f"with plan.shard / plan.indices)")
        for f in ("B", "H", "Hkv", "D", "dtype", "scale", "dropout"):
            if d[f] != rows[0][_FIELDS.index(f)]:
                problems.append(f"rank {r} differs from rank 0 in {f}")
    if problems:
        raise ValueError("context_parallel_attention: inconsistent call across ranks: " + "; ".join(problems))
    return rows[0][_FIELDS.index("seed")]
