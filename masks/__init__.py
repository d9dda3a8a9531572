"""Named mask patterns in the blocksparse_fa text DSL (one ``.mask`` file per pattern).

This folder is installed as ``blocksparse_fa.pattern_files``; load a pattern with
``blocksparse_fa.load_pattern(name, **overrides)``.
"""
