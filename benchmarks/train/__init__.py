"""Long-context training benchmark: a byte-level language model on the Python standard library's
source, with a long-range associative-recall probe, trained with dense SDPA, FlexAttention and
blocksparse_fa under ``torch.compile``.

Modules: ``data`` (corpus, split, windows, probe), ``model`` (decoder), ``variants`` (attention cores
and patterns), ``runner`` (training loop, timing, profiling), ``report`` (JSON merge, tables, plots),
``cli`` (command line). Entry point: ``python benchmarks/train_long_context.py``.
"""
