"""Context parallelism: one attention over a sequence sharded across ranks (torch.distributed).

    plan = plan_context_parallel(mask, seq_len, world_size, heads=(H, Hkv), head_dim=D)
    idx = plan.indices(rank)                      # this rank's tokens (also its RoPE positions)
    out = context_parallel_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx], plan=plan)

See ``docs/distributed.md``.
"""

from .api import context_parallel_attention
from .plan import ContextParallelPlan, CostModel, plan_context_parallel

__all__ = ["ContextParallelPlan", "CostModel", "context_parallel_attention", "plan_context_parallel"]
