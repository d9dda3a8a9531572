"""Progress bars for the slow analyses (tqdm, on stderr); off unless a caller asks for them."""

from __future__ import annotations


class _Off:
    """The no-op stand-in: same ``update`` and context-manager interface as a tqdm bar."""

    def update(self, n: int = 1) -> None:
        pass

    def __enter__(self) -> _Off:
        return self

    def __exit__(self, *exc) -> bool:
        return False


def progress_bar(enabled: bool, total: int, desc: str, unit: str = "it"):
    """A tqdm bar on stderr when ``enabled`` (tqdm hides it where stderr is not a terminal), else a
    no-op. Bars disappear when done (``leave=False``), so they never mix with a command's output."""
    if not enabled:
        return _Off()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=total >= 10_000, leave=False, disable=None,
                mininterval=0.25)
