"""Worker side of the multi-process context-parallel integration tests (training benchmark,
transformers hook): each case runs on every rank of a gloo group and rank 0 sends back what the
test compares with a single-process run. Importable by spawned processes (no pytest here)."""

from __future__ import annotations

import pathlib
import sys
import traceback
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

_BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
if str(_BENCH) not in sys.path:
    sys.path.insert(0, str(_BENCH))

GLOO_TIMEOUT = 60


# ------------------------------------------------------------------------------------------------
# training benchmark
# ------------------------------------------------------------------------------------------------
class SyntheticStream:
    """Deterministic random batches in the benchmark's format (text targets and a few answers)."""

    def __init__(self, L: int, batch: int, seed: int = 0):
        from train import data

        self.data, self.L, self.B = data, L, batch
        self.rng = np.random.default_rng(seed)

    def next(self):
        d, seqs = self.data, []
        for _ in range(self.B):
            tok = self.rng.integers(0, 300, self.L + 1)
            kind = np.where(self.rng.random(self.L) < 0.1, d.ANSWER, d.TEXT).astype(np.int8)
            kind[:3] = d.IGNORE
            doc = np.repeat(np.arange(self.L), self.rng.integers(5, 60, self.L))[:self.L].astype(np.int32)
            seqs.append((tok[:-1], tok[1:], doc, kind))
        return d.collate(seqs, 0.5)


def train_config(**kw):
    from train.runner import RunConfig
    from train.variants import Patterns

    cfg = RunConfig(device="cpu", seq_len=kw.get("L", 128), batch=2, layers=2, d_model=32, heads=4, kv_heads=2,
                    head_dim=8, steps=3, lr=3e-3, warmup=1, compile=False, log_every=0, sync_steps=0)
    pats = Patterns(block_size=16, longformer_window=16, longformer_global=16, bigbird_window=16,
                    bigbird_global=16, bigbird_random=1, sliding_window=24)
    return cfg, pats


CAPTURE = ("blocks.0.attn.qkv.weight", "emb.weight")


def run_train(case, group):
    """``train_cp`` on this rank's shards: per-step losses and captured gradients (rank 0)."""
    from train.cp import train_cp

    cfg, pats = train_config(**case)
    res = train_cp(cfg, pats, case["pattern"], SyntheticStream(cfg.seq_len, cfg.batch), group,
                   strategy=case.get("strategy", "auto"), dtype=torch.float64, capture=CAPTURE)
    return {"losses": res.losses, "grads": res.grads, "plan": res.plan.splitlines()[0]}


def run_train_reference(case):
    from train.cp import train_cp

    cfg, pats = train_config(**case)
    res = train_cp(cfg, pats, case["pattern"], SyntheticStream(cfg.seq_len, cfg.batch), None,
                   dtype=torch.float64, capture=CAPTURE)
    return {"losses": res.losses, "grads": res.grads}


# ------------------------------------------------------------------------------------------------
# transformers hook
# ------------------------------------------------------------------------------------------------
def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


HF_MASK = "causal & (window(24) | global_tokens(16))"


def hf_inputs(L: int):
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 97, (2, L), generator=g)


def run_hf(case, group):
    """A tiny Llama with the hook registered for context parallelism: the gathered logits and the
    all-reduced gradient of one weight (rank 0)."""
    from blocksparse_fa.distributed import plan_context_parallel
    from blocksparse_fa.integrations import transformers as hook

    L = case["L"]
    model = tiny_llama()
    plan = plan_context_parallel(HF_MASK, L, dist.get_world_size(group), block_size=16, heads=(4, 2), head_dim=8,
                                 strategy=case.get("strategy", "auto"))
    name = hook.register(HF_MASK, block_size=16, name=f"bsfa_cp_{case['name']}".replace(" ", "_"),
                         context_parallel=group, plan=plan)
    model.config._attn_implementation = name
    rank = dist.get_rank(group)
    ids = hf_inputs(L)
    idx = plan.indices(rank)
    out = model(input_ids=ids[:, idx], position_ids=idx[None].expand(ids.shape[0], -1))
    w = torch.randn(out.logits.shape[0], L, out.logits.shape[-1], dtype=torch.float64,
                    generator=torch.Generator().manual_seed(9))
    (out.logits * w[:, idx]).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if n in HF_CAPTURE}
    for g in grads.values():
        dist.all_reduce(g, group=group)
    logits = plan.gather(out.logits.detach(), 1, group=group)
    return {"logits": logits, "grads": grads}


HF_CAPTURE = ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight")


def run_hf_reference(case):
    from blocksparse_fa.integrations import transformers as hook

    L = case["L"]
    model = tiny_llama()
    model.config._attn_implementation = hook.register(HF_MASK, block_size=16, name="bsfa_cp_reference")
    ids = hf_inputs(L)
    out = model(input_ids=ids)
    w = torch.randn(out.logits.shape[0], L, out.logits.shape[-1], dtype=torch.float64,
                    generator=torch.Generator().manual_seed(9))
    (out.logits * w).sum().backward()
    hook.unregister("bsfa_cp_reference")
    return {"logits": out.logits.detach(),
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if n in HF_CAPTURE}}


# ------------------------------------------------------------------------------------------------
# FSDP2 on "dp" x context parallelism on "cp"
# ------------------------------------------------------------------------------------------------
FSDP_CAPTURE = ("blocks.0.attn.qkv.weight", "blocks.1.mlp.down.weight", "emb.weight")


def _fsdp_model(cfg, pats, family, group):
    from train.cp import CPCore
    from train.model import Decoder

    torch.manual_seed(cfg.seed)
    return Decoder(512, cfg.d_model, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim,
                   CPCore(pats.mask(family), pats.block_size, group)).to(torch.float64)


def run_fsdp(case, group):
    """A 2 x 2 mesh ("dp", "cp"): ``fully_shard`` on "dp" (one sequence per dp rank), the sequence
    sharded on "cp". One AdamW step: the loss, the unsharded gradients and the updated parameters
    (rank 0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from blocksparse_fa.distributed import plan_context_parallel
    from train.model import rope_tables

    cfg, pats = train_config(**case)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp, cp = mesh["dp"], mesh["cp"]
    model = _fsdp_model(cfg, pats, case["pattern"], cp)
    for blk in model.blocks:
        fully_shard(blk, mesh=dp)
    fully_shard(model, mesh=dp)
    for m in model.modules():  # sum over dp: every rank's loss is its share of the batch loss
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plan = plan_context_parallel(pats.mask(case["pattern"]), cfg.seq_len, 2, block_size=pats.block_size,
                                 strategy=case.get("strategy", "auto"))
    idx = plan.indices(cp.get_local_rank())
    b = SyntheticStream(cfg.seq_len, cfg.batch).next()  # 2 sequences: one per dp rank
    d = dp.get_local_rank()
    cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_base, "cpu")
    loss, _, _ = model(b.tokens[d:d + 1, idx], b.targets[d:d + 1, idx], b.weights[d:d + 1, idx].double(),
                       cos[idx], sin[idx], plan)
    loss.backward()
    for p in model.parameters():  # the replicas along "cp" hold partial gradients: sum them
        dist.all_reduce(p.grad.to_local(), group=cp.get_group())
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if n in FSDP_CAPTURE}
    opt.step()
    params = {n: p.detach().full_tensor() for n, p in model.named_parameters() if n in FSDP_CAPTURE}
    return {"loss": float(total), "grads": grads, "params": params}


def run_fsdp_reference(case):
    from train.model import rope_tables

    cfg, pats = train_config(**case)
    model = _fsdp_model(cfg, pats, case["pattern"], None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    b = SyntheticStream(cfg.seq_len, cfg.batch).next()
    cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_base, "cpu")
    loss, _, _ = model(b.tokens, b.targets, b.weights.double(), cos, sin, None)
    loss.backward()
    named = dict(model.named_parameters())
    grads = {n: named[n].grad.detach().clone() for n in FSDP_CAPTURE}
    opt.step()
    return {"loss": float(loss.detach()), "grads": grads,
            "params": {n: named[n].detach().clone() for n in FSDP_CAPTURE}}


# ------------------------------------------------------------------------------------------------
def _plain(x):
    """Tensors as numpy arrays (a queue would share tensors through file descriptors that die with the
    process)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


RUNNERS = {"train": run_train, "hf": run_hf, "fsdp": run_fsdp}


def bench_worker(rank, world, store_path, case, queue):
    """``benchmarks/context_parallel.py run`` on this rank, as under torchrun (env:// rendezvous on
    ``case["port"]``)."""
    import os

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(case["port"]), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        import context_parallel

        context_parallel.main(case["argv"])
        queue.put((rank, "bench", True, None))
    except BaseException:  # noqa: BLE001  (reported; the test fails with the traceback)
        queue.put((rank, "bench", False, traceback.format_exc(limit=8)))
    queue.put((rank, "<done>", True, None))


def worker(rank, world, store_path, cases, queue):
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=GLOO_TIMEOUT))
        for case in cases:
            try:
                res = RUNNERS[case["kind"]](case, dist.group.WORLD)
                queue.put((rank, case["name"], True, _plain(res) if rank == 0 else None))
            except Exception:  # noqa: BLE001  (reported; the test fails with the traceback)
                queue.put((rank, case["name"], False, traceback.format_exc(limit=6)))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        queue.put((rank, "<worker>", False, traceback.format_exc(limit=6)))
    queue.put((rank, "<done>", True, None))
