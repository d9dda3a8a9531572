"""Side-by-side check of the work-list split rule: ours (split on), ours (split off), Flex; N=16K, d=128, H=16."""
import torch, triton
import blocksparse_fa as bsfa
from blocksparse_fa.ops.triton_backend import set_split_chunk
from torch.nn.attention.flex_attention import flex_attention, create_block_mask
for name in ("cache_size_limit", "recompile_limit"):
    if hasattr(torch._dynamo.config, name):
        setattr(torch._dynamo.config, name, 1000)
flex = torch.compile(flex_attention)
N, H, D = 16384, 16, 128
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = (torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
q, k, v = (t.requires_grad_() for t in (q, k, v))
bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
def fb(f):
    def g_():
        f().backward(do)
    return g_
import numpy as np
bbm = bsfa.load_pattern("bigbird"); rb = [l for l in bbm.leaves() if l.name == "random_blocks"][0]
grid = np.zeros((128, 128), bool); np.put_along_axis(grid, rb.chosen(np.arange(128), 128), True, axis=1); gt = torch.from_numpy(grid).cuda()
cases = {"longformer": (bsfa.load_pattern("longformer"), lambda b, h, i, j: ((i - j).abs() <= 256) | (i < 64) | (j < 64)),
         "bigbird": (bbm, lambda b, h, i, j: ((i - j).abs() <= 192) | (i < 128) | (j < 128) | gt[i // 128, j // 128])}
for name, (m, mm) in cases.items():
    bm = create_block_mask(mm, None, None, N, N, device="cuda")
    fl = lambda: flex(q, k, v, block_mask=bm)
    ours = lambda: bsfa.attention(q, k, v, mask=m)
    res = {}
    for label, chunk in (("split", None), ("nosplit", 1e12)):
        set_split_chunk(chunk)
        with torch.no_grad():
            t_f = bench(ours)
        res[label] = (t_f, bench(fb(ours)))
    set_split_chunk(None)
    with torch.no_grad():
        o1, o2 = ours(), fl()
        tf = bench(fl)
    tfb = bench(fb(fl))
    err = ((o1.float() - o2.float()).norm() / o2.float().norm()).item()
    print(f"{name:10s} ours split {res['split'][0]:.3f}/{res['split'][1]:.3f} ms | ours no-split {res['nosplit'][0]:.3f}/{res['nosplit'][1]:.3f} "
          f"| flex {tf:.3f}/{tfb:.3f} | speedup split {tf/res['split'][0]:.2f}x/{tfb/res['split'][1]:.2f}x | err {err:.1e}", flush=True)
