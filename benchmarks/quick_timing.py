"""Quick side-by-side timing (ours vs FlexAttention vs SDPA) for a few patterns; a smoke version of bench.py."""
import torch, triton
import blocksparse_fa as bsfa
from torch.nn.attention.flex_attention import flex_attention, create_block_mask
from torch.nn.attention import sdpa_kernel, SDPBackend
import torch.nn.functional as F
flex = torch.compile(flex_attention)
N, H, D = 16384, 16, 128
q, k, v = (torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn_like(q)
def bench(f):
    return triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
def fb(f):
    def g():
        o = f(); o.backward(do)
    return g
cases = {
  "dense": (bsfa.full(), None, "flash"),
  "causal": (bsfa.causal(), lambda b, h, qi, ki: ki <= qi, "flash"),
  "sliding1024": (bsfa.sliding_window(1024), lambda b, h, qi, ki: (qi - ki >= 0) & (qi - ki < 1024), None),
  "longformer": (bsfa.load_pattern("longformer"), lambda b, h, qi, ki: ((qi - ki).abs() <= 256) | (qi < 64) | (ki < 64), None),
}
for name, (m, mm, sd) in cases.items():
    ours = lambda: bsfa.attention(q, k, v, mask=m)
    t_o = bench(ours); t_ob = bench(fb(ours))
    o = ours()
    if mm is None:
        fl = lambda: flex(q, k, v)
    else:
        bm = create_block_mask(mm, 1, 1, N, N, device="cuda", _compile=True)
        fl = lambda: flex(q, k, v, block_mask=bm)
    t_f = bench(fl); t_fb = bench(fb(fl))
    err = ((o.float() - fl().float()).norm() / fl().float().norm()).item()
    line = f"{name:12s} ours fwd {t_o:7.3f} ms fwdbwd {t_ob:7.3f} | flex {t_f:7.3f} {t_fb:7.3f} | ratio fwd {t_f/t_o:5.2f}x fb {t_fb/t_ob:5.2f}x | err vs flex {err:.1e}"
    if sd:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            s = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=(name == "causal"))
            line += f" | sdpa-flash {bench(s):7.3f} {bench(fb(s)):7.3f}"
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                s = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=(name == "causal"))
                line += f" | cudnn {bench(s):7.3f} {bench(fb(s)):7.3f}"
        except Exception as e:
            line += f" | cudnn n/a ({type(e).__name__})"
    print(line, flush=True)
