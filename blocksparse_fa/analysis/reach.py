"""Reachability of a pattern's block graph: how many layers until information can mix.

One attention layer lets query block ``r`` draw on key block ``c`` when the layout's block ``(r, c)``
is non-empty. Stacking layers (with the residual stream carrying each position's own state forward)
composes these hops: after ``L`` layers, position block ``r`` can depend on block ``c`` iff the
**block graph** -- nodes are blocks of ``block_size`` positions, a directed edge ``c -> r`` for every
non-empty layout block ``(r, c)`` -- has a path from ``c`` to ``r`` of at most ``L`` edges. The
shortest such path is the number of layers the information needs.

Reported (all counted in layers):

* ``diameter``: layers until *every* query block can draw on *every* key block -- the graph's
  diameter, finite only when it is strongly connected; ``None`` ("never") otherwise, e.g. for any
  causal pattern (early blocks never see late ones).
* ``causal_layers``: layers until every query block draws on every block at or before it (``c <= r``)
  -- the meaningful "full mixing" for causal patterns; ``None`` if some earlier block is never
  reachable (chunked attention, packed documents).
* ``closure_layers``: layers until every query block draws on every key block it can *ever* reach
  (the largest finite shortest-path distance).
* ``reach_fraction``: fraction of all ``(query block, key block)`` pairs connected within ``layers``
  layers; ``causal_reach_fraction`` the same over pairs with ``c <= r``; ``eventual_fraction`` over
  all pairs with no layer limit.
* hubs: blocks of highest degree (in + out, self-loops excluded) and of highest betweenness
  centrality (networkx, normalised; on graphs of more than ``exact_betweenness_max`` blocks
  estimated from that many sampled sources, scaled by ``n / k`` as in Brandes and Pich, 2007).

The analysis is at block granularity, so it is an over-approximation of token-level reachability:
one kept token pair makes a block edge.

Needs networkx (``pip install "blocksparse_fa[analysis]"``).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

try:
    import networkx as nx
except ImportError as e:
    raise ImportError("the reachability analysis needs networkx: pip install 'blocksparse_fa[analysis]'") from e

from ..compiler.compile import compile_mask
from ..compiler.layout import BlockLayout
from ..mask.dsl import parse
from ..mask.expr import Mask
from ._progress import progress_bar

__all__ = ["Reachability", "analyze", "block_graph", "block_adjacency", "layer_distances"]

UNREACHABLE = -1


@dataclass
class Reachability:
    """Result of :func:`analyze`. Layer counts are ``None`` where the answer is "never"."""

    pattern: str
    n: int
    block_size: int
    layers: int
    n_blocks: int
    density: float
    n_edges: int
    strongly_connected: bool
    n_components: int
    diameter: int | None
    causal_layers: int | None
    closure_layers: int
    reach_fraction: float
    causal_reach_fraction: float
    eventual_fraction: float
    hubs_degree: list = field(default_factory=list)
    hubs_betweenness: list = field(default_factory=list)
    dist: np.ndarray | None = field(default=None, repr=False, compare=False)
    """``(T, T)`` int: layers for key block ``c`` to reach query block ``r`` at ``dist[r, c]``; -1 never."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("dist", None)
        return d

    def summary(self) -> str:
        def lay(x):
            return "never" if x is None else str(x)

        hubs_d = ", ".join(f"{b} (deg {d})" for b, d in self.hubs_degree)
        hubs_b = ", ".join(f"{b} ({c:.3f})" for b, c in self.hubs_betweenness)
        return "\n".join([
            f"pattern: {self.pattern}",
            f"  length {self.n}, block {self.block_size}: {self.n_blocks} blocks, {self.n_edges} non-empty layout "
            f"blocks (density {self.density:.4f})",
            f"  strongly connected: {'yes' if self.strongly_connected else 'no'} "
            f"({self.n_components} strongly connected component{'s' if self.n_components != 1 else ''})",
            f"  layers until every query block draws on every key block (diameter): {lay(self.diameter)}",
            f"  layers until every query block draws on every earlier block: {lay(self.causal_layers)}",
            f"  layers until every query block draws on all it can ever reach: {self.closure_layers}",
            f"  block pairs reachable within {self.layers} layer(s): {self.reach_fraction:.4f} of all, "
            f"{self.causal_reach_fraction:.4f} of causal (c <= r); ever: {self.eventual_fraction:.4f}",
            f"  hubs by degree: {hubs_d}",
            f"  hubs by betweenness: {hubs_b}",
        ])


def _mask_of(mask) -> Mask:
    if isinstance(mask, str):
        return parse(mask)
    if isinstance(mask, Mask):
        return mask
    raise TypeError(f"mask must be a Mask or DSL text, got {type(mask).__name__}")


def block_adjacency(layout: BlockLayout, instance: int = 0) -> np.ndarray:
    """``bool (T, T)``: ``A[r, c]`` when layout block ``(r, c)`` is non-empty (self-attention layouts)."""
    if layout.q_len != layout.kv_len or layout.block_size[0] != layout.block_size[1]:
        raise ValueError("reachability needs a square self-attention layout (q_len == kv_len, bm == bn)")
    tr, tc = layout.shape[-2:]
    rows, cols, _ = layout.nonempty_blocks()
    sel = rows // tr == instance
    a = np.zeros((tr, tc), dtype=bool)
    a[rows[sel] % tr, cols[sel]] = True
    return a


def block_graph(layout_or_adj, block_size: int | None = None) -> nx.DiGraph:
    """The block graph: node ``b`` per block (attribute ``positions = (start, stop)``), an edge
    ``c -> r`` for each non-empty layout block ``(r, c)`` (self-loops included)."""
    if isinstance(layout_or_adj, BlockLayout):
        adj = block_adjacency(layout_or_adj)
        bs, n = layout_or_adj.block_size[0], layout_or_adj.q_len
    else:
        adj = np.asarray(layout_or_adj, dtype=bool)
        bs = block_size or 1
        n = adj.shape[0] * bs
    return _graph(adj, bs, n, self_loops=True)


def _graph(adj: np.ndarray, bs: int, n: int, self_loops: bool, progress: bool = False) -> nx.DiGraph:
    g = nx.DiGraph()
    for b in range(adj.shape[0]):
        g.add_node(b, positions=(b * bs, min((b + 1) * bs, n)))
    r, c = np.nonzero(adj if self_loops else adj & ~np.eye(adj.shape[0], dtype=bool))
    chunk = 1 << 18
    with progress_bar(progress and len(r) > chunk, len(r), "block graph", "edges") as bar:
        for k in range(0, len(r), chunk):
            g.add_edges_from(zip(c[k:k + chunk].tolist(), r[k:k + chunk].tolist()))
            bar.update(min(chunk, len(r) - k))
    return g


def _betweenness(g: nx.DiGraph, k: int | None, progress: bool = False) -> dict:
    """Normalised betweenness centrality of ``g`` (directed, endpoints excluded) from all sources, or
    estimated from ``k`` sources sampled with seed 0 and scaled by ``n / k``. Computed in batches of
    sources (``networkx.betweenness_centrality_subset``) so that a progress bar can follow it."""
    nodes = list(g)
    n = len(nodes)
    if n < 3:
        return dict.fromkeys(nodes, 0.0)
    sources = nodes if k is None or k >= n else random.Random(0).sample(nodes, k)
    total = dict.fromkeys(nodes, 0.0)
    step = 8
    with progress_bar(progress, len(sources), "betweenness", "sources") as bar:
        for i in range(0, len(sources), step):
            part = nx.betweenness_centrality_subset(g, sources[i:i + step], nodes, normalized=False)
            for v, x in part.items():
                total[v] += x
            bar.update(len(sources[i:i + step]))
    scale = n / len(sources) / ((n - 1) * (n - 2))
    return {v: x * scale for v, x in total.items()}


def layer_distances(adj: np.ndarray, progress: bool = False) -> np.ndarray:
    """``dist[r, c]``: fewest layers for key block ``c`` to reach query block ``r`` (0 on the
    diagonal: the residual stream), ``-1`` if never. Boolean matrix iteration ``R <- (I | A) R``
    (one matrix product per layer; ``progress`` shows a bar over the layers)."""
    t = adj.shape[0]
    step = torch.from_numpy(adj | np.eye(t, dtype=bool)).to(torch.float32)
    reach = torch.eye(t, dtype=torch.float32)
    dist = torch.full((t, t), UNREACHABLE, dtype=torch.int64)
    dist[reach > 0] = 0
    with progress_bar(progress and t > 512, t, "layers", "layers") as bar:
        for layer in range(1, t + 1):
            new = ((step @ reach) > 0).to(torch.float32)
            fresh = (new > 0) & (reach == 0)
            if not fresh.any():
                break
            dist[fresh] = layer
            reach = new
            bar.update(1)
    return dist.numpy()


def analyze(mask, n: int, layers: int, block_size: int = 128, *, top: int = 3,
            exact_betweenness_max: int = 256, progress: bool = False) -> Reachability:
    """Reachability analysis of ``mask`` for self-attention over ``n`` positions.

    Args:
        mask: a :class:`~blocksparse_fa.Mask` or DSL text / pattern name.
        n: sequence length.
        layers: depth ``L`` at which ``reach_fraction`` is measured.
        block_size: block size of the layout (the graph's granularity).
        top: number of hubs reported.
        exact_betweenness_max: above this many blocks betweenness is estimated from that many sampled
            sources (deterministic seed).
        progress: show progress bars (tqdm, on stderr where it is a terminal) for the slow steps
            (graph, distances and betweenness of long sequences).

    Returns:
        A :class:`Reachability`.
    """
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
        raise ValueError(f"layers must be a non-negative int, got {layers!r}")
    m = _mask_of(mask)
    layout = compile_mask(m, n, n, block_size)
    adj = block_adjacency(layout)
    t = adj.shape[0]
    dist = layer_distances(adj, progress)
    reach = dist >= 0
    lower = np.tril(np.ones((t, t), dtype=bool))
    simple = _graph(adj, block_size, n, self_loops=False, progress=progress)  # self-loops change no answer
    strongly = nx.is_strongly_connected(simple)
    n_comp = nx.number_strongly_connected_components(simple)
    diameter = int(dist.max()) if strongly else None
    causal_ok = bool(reach[lower].all())
    causal_layers = int(dist[lower].max()) if causal_ok else None
    within = reach & (dist <= layers)

    deg = dict(simple.degree())
    hubs_degree = sorted(deg.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    bc = _betweenness(simple, exact_betweenness_max if t > exact_betweenness_max else None, progress)
    hubs_bc = sorted(bc.items(), key=lambda kv: (-kv[1], kv[0]))[:top]

    return Reachability(
        pattern=str(m), n=n, block_size=block_size, layers=layers, n_blocks=t, density=float(layout.density),
        n_edges=int(adj.sum()), strongly_connected=bool(strongly), n_components=int(n_comp), diameter=diameter,
        causal_layers=causal_layers, closure_layers=int(dist.max()),
        reach_fraction=float(within.mean()), causal_reach_fraction=float(within[lower].mean()),
        eventual_fraction=float(reach.mean()),
        hubs_degree=[(int(b), int(d)) for b, d in hubs_degree],
        hubs_betweenness=[(int(b), float(c)) for b, c in hubs_bc],
        dist=dist,
    )
