"""``bsfa analyze``: how many layers a pattern needs until information can mix (block-graph reachability)."""

from __future__ import annotations

import json

import torch

from ..mask.dsl import parse
from ..mask.patterns import _pattern_names, load_pattern, pattern_info


def register(sub) -> None:
    p = sub.add_parser("analyze", help="reachability of a pattern's block graph across layers (networkx)")
    p.add_argument("pattern", help="pattern name (see 'bsfa patterns') or DSL text, e.g. \"causal & window(256)\"")
    p.add_argument("--len", dest="n", type=int, required=True, help="sequence length")
    p.add_argument("--layers", type=int, required=True, help="depth L at which reachable block pairs are counted")
    p.add_argument("--block", type=int, default=128, help="block size: the graph's granularity (default 128)")
    p.add_argument("--documents", type=int, default=None, metavar="MEAN_LEN",
                   help="supply a 'document' tensor: random block-aligned documents of about this mean length "
                        "(seeded; for patterns such as document_causal)")
    p.add_argument("--seed", type=int, default=0, help="seed of --documents")
    p.add_argument("--top", type=int, default=3, help="hubs to report")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def random_documents(n: int, mean_len: int, block: int, seed: int = 0) -> torch.Tensor:
    """Sorted document ids ``(n,)``: lengths uniform in ``[mean/2, 3·mean/2]`` rounded to whole blocks
    (so the block graph is exact), deterministic in ``seed``."""
    if mean_len < 1:
        raise ValueError(f"--documents must be positive, got {mean_len}")
    g = torch.Generator().manual_seed(seed)
    lo, hi = max(1, mean_len // 2 // block), max(1, (3 * mean_len) // 2 // block)
    lens = []
    total = 0
    while total < n:
        k = int(torch.randint(lo, hi + 1, (1,), generator=g)) * block
        lens.append(k)
        total += k
    ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    return ids[:n]


def mask_for(text: str, n: int, block: int, documents: int | None, seed: int = 0):
    text = text.strip()
    tensors = {}
    if documents is not None:
        tensors["document"] = random_documents(n, documents, block, seed)
    if text in _pattern_names():
        info = pattern_info(text)
        if "document" in info.tensors and "document" not in tensors:
            raise ValueError(f"pattern '{text}' needs document ids: pass --documents MEAN_LEN")
        return load_pattern(text, **{k: v for k, v in tensors.items() if k in info.tensors})
    return parse(text, **tensors)


def run(args) -> int:
    from ..analysis.reach import analyze

    mask = mask_for(args.pattern, args.n, args.block, args.documents, args.seed)
    res = analyze(mask, args.n, args.layers, args.block, top=args.top)
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
    else:
        print(res.summary())
    return 0
