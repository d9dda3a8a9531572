"""Integrations with other libraries (imported on demand: ``blocksparse_fa.integrations.transformers``)."""
