import torch, blocksparse_fa as bsfa
from blocksparse_fa.ops import launcher as L
orig_first = L.Launch._first
def _first(self, key, grid, args):
    ck = self.fn.warmup(*args, grid=grid, **self.consts)
    seen = []
    cls = type(ck); prop = cls.__dict__.get("run")
    launcher = ck.run
    def record(*a):
        seen.append(a); return launcher(*a)
    cls.run = property(lambda obj: record if obj is ck else prop.__get__(obj))
    try:
        self.fn[grid](*args, **self.consts)
    finally:
        cls.run = prop
    a = seen[0]; n = len(args)
    print(self.fn.__name__ if hasattr(self.fn,'__name__') else self.fn, "recorded", len(a), "args", n)
    for i,(x,y) in enumerate(zip(a[9:9+n], args)):
        if not (x is y or (not isinstance(x, torch.Tensor) and x == y)):
            print("  mismatch at", i, type(x), type(y), repr(x)[:60], repr(y)[:60])
    print("  head", [type(t).__name__ for t in a[:9]], "tail", [repr(t)[:30] for t in a[9+n:]][:12])
    raise SystemExit
L.Launch._first = _first
q = torch.randn(1, 2, 1024, 64, device="cuda", dtype=torch.bfloat16)
bsfa.attention(q, q, q, mask=bsfa.causal())
