"""Test setup: Triton kernels run in the interpreter on CPU (must be set before kernels are imported)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64 (0 when both are 0)."""
    a, b = a.double(), b.double()
    nb = b.norm().item()
    return (a - b).norm().item() / nb if nb > 0 else (a - b).norm().item()


@pytest.fixture
def cpu_path(monkeypatch):
    """``cpu_path("walk" | "dense" | "model")``: what ``backend="auto"`` runs on CPU in this test
    (block walking always, the dense SDPA path whenever it applies, or the cost model)."""
    from blocksparse_fa.ops import dense

    def force(path):
        weight = {"walk": float("inf"), "dense": 0.0, "model": dense.COST["dense"]}[path]
        monkeypatch.setitem(dense.COST, "dense", weight)

    return force


@pytest.fixture
def fake_tqdm(monkeypatch):
    """Replace ``tqdm.tqdm`` with a recorder; returns the list of bars made (total, desc, n)."""
    import tqdm

    made = []

    class Bar:
        def __init__(self, *args, total=None, desc="", **kwargs):
            self.total, self.desc, self.n = total, desc, 0
            made.append(self)

        def update(self, n=1):
            self.n += n

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    return made
