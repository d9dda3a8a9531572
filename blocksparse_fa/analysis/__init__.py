"""Analyses of patterns and kernels: ``iosim`` (IO model), ``traffic`` (memory traffic model),
``reach`` (block-graph reachability across layers). Import the submodules directly; the
reachability names are also available here, loaded on first use (networkx is imported lazily)."""

_REACH = ("Reachability", "analyze", "block_graph")


def __getattr__(name):
    if name in _REACH:
        from . import reach

        return getattr(reach, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
