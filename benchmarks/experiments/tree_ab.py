"""Two source trees side by side on one GPU: per mask, the host time to launch one eager fwd+bwd, the
GPU time by kernel and the ``do_bench`` wall, plus the gradients' largest difference from the
other tree's (saved under ``/tmp``). Run it once per tree, in alternating processes:

    git archive HEAD blocksparse_fa masks | tar -x -C old_tree     # the previous tree, untracked
    TAG=old PYTHONPATH=old_tree:. python benchmarks/experiments/tree_ab.py bigbird longformer
    TAG=new PYTHONPATH=. python benchmarks/experiments/tree_ab.py bigbird longformer

Masks: ``bench.py``'s names (H 16) or a part of a ``flex_equivalents.py`` name (H 8, its batch),
16K, d 128, bf16. The host time is the best of five runs of 20 calls made while the GPU sleeps
50 ms (the launch queue never waits); GPU time: ``torch.profiler``, mean of 10 calls. Results:
``$OUT/tree_ab_<TAG>_<pid>.json`` and a line per mask.
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import blocksparse_fa as bsfa  # noqa: E402
from bench import MASKS, make_case  # noqa: E402
from flex_equivalents import cases  # noqa: E402
from host_new_primitives import gpu_kernels  # noqa: E402
from host_path import host_runs_us  # noqa: E402


def _cases(names, n):
    flex = cases(n, H=8, device="cuda")
    for name in names:
        if name in MASKS or name.startswith(("sliding_window_", "strided_", "sinks_window_")):
            yield name, make_case(name, n, "cuda")[0], 1, 16
            continue
        hits = [(nm, m, B) for nm, m, _, (B, _) in flex if name in nm]
        if not hits:
            raise SystemExit(f"unknown mask {name!r}")
        yield hits[0][0], hits[0][1], hits[0][2], 8


def main():
    from triton.testing import do_bench

    tag = os.environ.get("TAG", "new")
    names = sys.argv[1:] or ["bigbird", "longformer", "causal_longformer"]
    n, res = 16384, {}
    print(tag, bsfa.__file__, flush=True)
    for name, mask, B, H in _cases(names, n):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, H, n, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        leaves = [t.requires_grad_() for t in (q, k, v)]

        def step():
            return torch.autograd.grad(bsfa.attention(q, k, v, mask=mask), leaves, do)

        for _ in range(5):
            grads = step()
        torch.cuda.synchronize()
        path = f"/tmp/tree_ab_grads_{''.join(c if c.isalnum() else '_' for c in name)}.pt"
        diff = None
        if os.path.exists(path):
            other = torch.load(path)
            diff = max((a.float().cpu() - b.float()).abs().max().item() for a, b in zip(grads, other))
        torch.save([x.cpu() for x in grads], path)
        hosts = host_runs_us(step)
        kernels = gpu_kernels(step, calls=10)
        wall = do_bench(step, warmup=25, rep=200, return_mode="median")
        ex = bsfa.explain(q, k, v, mask)
        res[name] = dict(host_us=min(hosts), host_runs=hosts, gpu_ms=sum(kernels.values()), kernels=kernels,
                         wall_ms=wall, forward=ex.forward, backward=ex.backward, grad_diff_vs_last=diff)
        print(f"{tag} {name[:24]:24s} {ex.forward:15s} {ex.backward:15s} host {min(hosts):6.0f} us  "
              f"gpu {sum(kernels.values()):.3f} ms  wall {wall:.3f} ms  grads vs last {diff}", flush=True)
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"tree_ab_{tag}_{os.getpid()}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
