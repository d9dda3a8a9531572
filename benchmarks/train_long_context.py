"""Long-context training benchmark: a byte-level language model on the Python standard library's
source, trained with dense SDPA, FlexAttention and blocksparse_fa under ``torch.compile``; reports
tokens/s, GPU busy, peak memory, setup and compile time, held-out bits per byte and a long-range
recall probe at equal steps.

    python benchmarks/train_long_context.py --device cpu                          # tiny CPU run, seconds
    python benchmarks/train_long_context.py run --deadline 540 --json /tmp/a.json   # GPU, 64K, ~9.5 min
    python benchmarks/train_long_context.py throughput --deadline 250 --json /tmp/b.json  # 16K/32K/128K
    python benchmarks/train_long_context.py report /tmp/a.json /tmp/b.json   # docs/training.md, figures
    torchrun --nproc-per-node 2 benchmarks/train_long_context.py cp --pattern longformer  # sequence sharded

``run`` trains the variants in priority order (dense, ours and Flex Longformer first, for the same
number of steps; then the other patterns as the deadline allows; what it leaves out is recorded).

``cp`` trains with context parallelism: every sequence sharded across the ranks of a ``torchrun``
job (blocksparse_fa's ``context_parallel`` attention), losses and gradients equal to one process.

The code lives in ``benchmarks/train/`` (data, model, variants, runner, report, cli, cp); see
``docs/training.md`` for the method and the results. This script imports the repository's own
``blocksparse_fa`` (the repository root is put first on ``sys.path``).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):  # benchmarks/ (for train/), then the repository root
    if _p not in sys.path:
        sys.path.insert(0, _p)

from train.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
