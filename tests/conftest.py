"""Test setup: Triton kernels run in the interpreter on CPU (must be set before kernels are imported);
with pytest-xdist installed the suite runs in one worker process per CPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

MAX_WORKERS = 8  # each worker imports torch (and, in some tests, spawns gloo ranks)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """``python -m pytest`` spreads the tests over the CPUs (``-n logical``, at most ``MAX_WORKERS``)
    when pytest-xdist is installed and no ``-n``/``--dist`` was given; ``-n 0`` runs in this process.
    Without pytest-xdist the suite runs in one process, unchanged. (A hook rather than ``addopts``
    so that a missing plugin is no error.)"""
    if hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist"):
        return
    if config.option.numprocesses is None and config.option.dist == "no" and not config.option.tx:
        config.option.numprocesses = "logical"
        if config.option.maxprocesses is None:
            config.option.maxprocesses = MAX_WORKERS


def _worker_threads() -> None:
    """Share the CPUs between the xdist workers instead of giving every worker all of them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cpus // workers))


_worker_threads()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64 (0 when both are 0)."""
    a, b = a.double(), b.double()
    nb = b.norm().item()
    return (a - b).norm().item() / nb if nb > 0 else (a - b).norm().item()


def check_route_against_float64(mask, route: str, kernel_options: dict, H: int = 2, Hkv: int = 1, D: int = 16,
                                n: int = 128, n_k: int | None = None, seed: int = 0, block_size: int = 32):
    """``bsfa.attention`` on the Triton backend with ``kernel_options``: both phases noted as
    ``route`` (``select.record``), the output and logsumexp and every gradient (a random weight on
    each) within 5e-6 of the float64 reference."""
    import blocksparse_fa as bsfa
    from blocksparse_fa.ops import select

    torch.manual_seed(seed)
    q = torch.randn(1, H, n, D, requires_grad=True)
    k, v = (torch.randn(1, Hkv, n_k or n, D, requires_grad=True) for _ in range(2))
    with select.record() as ran:
        out, lse = bsfa.attention(q, k, v, mask, backend="triton", block_size=block_size, return_lse=True,
                                  kernel_options=kernel_options)
        do, dl = torch.randn_like(out), torch.randn_like(lse)
        grads = torch.autograd.grad((out, lse), (q, k, v), (do, dl))
    assert ("forward", route) in ran and ("backward", route) in ran, ran
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = bsfa.reference_attention(qd, kd, vd, mask, return_lse=True)
    ref_grads = torch.autograd.grad((ref, ref_lse), (qd, kd, vd), (do.double(), dl.double()))
    assert rel_err(out, ref) < 5e-6 and torch.allclose(lse.double(), ref_lse, atol=1e-5)
    for g, r, name in zip(grads, ref_grads, "qkv"):
        assert rel_err(g, r) < 5e-6, (name, rel_err(g, r))
    return ran


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
