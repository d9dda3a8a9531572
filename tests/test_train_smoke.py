"""The long-context training benchmark (benchmarks/train_long_context.py, benchmarks/train/) at tiny
CPU sizes: the data split, the recall probe's construction, the FlexAttention mask translation and
block masks (built from block states, equal to ``create_block_mask``'s, without evaluating the
``L x L`` mask), the deadline planning, a short run of two variants with its JSON, and the report."""

from __future__ import annotations

import json
import pathlib
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

import blocksparse_fa as bsfa

_BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
if str(_BENCH) not in sys.path:
    sys.path.insert(0, str(_BENCH))

from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402

from train import cli, data, report, runner, variants  # noqa: E402
from train.model import Decoder, rope_tables  # noqa: E402
from train.variants import (BsfaCore, Patterns, SDPACore, Variant, block_mask_from_states,  # noqa: E402
                            document_block_states, layout_block_states, mask_mod_from)

TINY = ["--device", "cpu", "--seq-len", "256", "--batch", "1", "--layers", "2", "--d-model", "64", "--heads", "4",
        "--kv-heads", "2", "--block-size", "32", "--sliding-window", "32", "--longformer-window", "16",
        "--longformer-global", "32", "--bigbird-window", "16", "--bigbird-global", "32", "--bigbird-random", "1",
        "--probe-pairs", "6", "--eval-windows", "1", "--eval-probes", "1", "--threads", "1", "--quiet"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only contend
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def corpus():
    return data.load_corpus(None, 30)


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------
def test_split_is_deterministic_and_disjoint_by_file(corpus):
    again = data.load_corpus.__wrapped__(None, 30)  # a fresh read, not the cached object
    assert again.info["sha256"] == corpus.info["sha256"]
    assert np.array_equal(again.train.tokens, corpus.train.tokens)
    assert np.array_equal(again.held.tokens, corpus.held.tokens)
    tr, he = set(corpus.train.files), set(corpus.held.files)
    assert not tr & he
    assert tr | he == {rel for rel, _ in data.stdlib_files()}
    assert corpus.train.files == sorted(corpus.train.files)
    assert 0.005 < len(he) / (len(tr) + len(he)) < 0.1
    assert all(data.is_held_out(r, 30) for r in he) and not any(data.is_held_out(r, 30) for r in tr)
    # every file opens with BOS and owns a contiguous run of document ids
    for split in (corpus.train, corpus.held):
        starts = np.flatnonzero(np.diff(split.doc, prepend=-1))
        assert np.array_equal(starts, np.flatnonzero(split.tokens == data.BOS))
        assert np.array_equal(split.doc[starts], np.arange(len(split.files)))
        assert split.tokens.max() == data.BOS  # bytes and BOS only
    info = corpus.info
    assert 3.0 < info["unigram_entropy_bpb"] < 8.0 and 3.0 < info["unigram_heldout_bpb"] < 8.0


def test_text_windows_and_batches(corpus):
    tok, tgt, doc, kind = data.text_window(corpus.train, 1000, 300)
    assert np.array_equal(tgt[:-1], tok[1:])
    assert doc[0] == 0 and np.all(np.diff(doc) >= 0)
    assert np.array_equal(kind == data.TEXT, tgt < 256)
    spec = data.probe_spec(256, 6, 64, 3)
    s1 = data.TrainStream(corpus, 256, 2, spec, probe_rate=0.5, seed=3)
    s2 = data.TrainStream(corpus, 256, 2, spec, probe_rate=0.5, seed=3)
    for _ in range(4):  # the same seed gives the same batches (every variant sees the same data)
        a, b = s1.next(), s2.next()
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.weights, b.weights)
        # loss weights: the text targets' weights sum to 1, the answers' to probe_weight
        w, k = a.weights, a.kind
        assert w[k == data.TEXT].sum().item() == pytest.approx(1.0, rel=1e-5)
        if (k == data.ANSWER).any():
            assert w[k == data.ANSWER].sum().item() == pytest.approx(1.0, rel=1e-5)
        assert (w[k == data.IGNORE] == 0).all()


def _reachable(mask: bsfa.Mask, L: int, layers: int) -> torch.Tensor:
    """``R[t, j]``: information at position j can reach position t through ``layers`` layers."""
    m = mask.to_dense(L, L).float()
    r = torch.eye(L)
    for _ in range(layers):
        r = ((m @ r) > 0).float()
    return r > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_probe_answer_is_outside_every_window(corpus, seed):
    L, layers, n = 512, 2, 6
    pats = Patterns(block_size=32, sliding_window=48, longformer_window=24, longformer_global=32,
                    bigbird_window=24, bigbird_global=32, bigbird_random=1)
    reach = layers * pats.max_hop()
    spec = data.probe_spec(L, n, reach, 4)
    assert not spec.window_reachable and len(spec.rounds) >= 2
    rng = np.random.default_rng(seed)
    tok, tgt, doc, kind = data.probe_sequence(rng, corpus.train, spec)
    assert tok[0] == data.PROBE and (doc == 0).all()
    keys, vals = tok[1:1 + 2 * n:2], tok[2:1 + 2 * n:2]
    assert len(set(keys.tolist())) == n and ((keys >= data.KEY0) & (keys < data.KEY0 + data.N_KEYS)).all()
    assert ((vals >= data.VAL0) & (vals < data.VAL0 + data.N_VALS)).all()
    answers = np.flatnonzero(kind == data.ANSWER)
    assert len(answers) == n * len(spec.rounds)
    value_of = dict(zip(keys.tolist(), vals.tolist()))
    sliding = _reachable(pats.mask("sliding"), L, layers)
    longformer = _reachable(pats.mask("longformer"), L, layers)
    for t in answers:
        key = int(tok[t])
        assert tgt[t] == value_of[key] == tok[t + 1]
        earlier = np.flatnonzero(tok[:t] == key)
        assert len(earlier) >= 1 and earlier[0] < spec.prefix_len
        # no earlier occurrence of the key or of its value slot is within reach of the query ...
        assert (t - earlier > reach).all()
        assert not sliding[t, earlier].any() and not sliding[t, earlier + 1].any()
        # ... so the window model's whole receptive field is independent of the answer; the
        # Longformer (window + global tokens) model reaches the prefix pair directly
        assert longformer[t, earlier[0]] and longformer[t, earlier[0] + 1]
    # the key's other occurrences are only in earlier rounds; other scored values are other keys'
    assert set(tgt[answers].tolist()) <= set(vals.tolist())


def test_probe_spec_flags_lengths_a_window_could_reach():
    assert data.probe_spec(4096, 8, 1000, 4).window_reachable is False
    s = data.probe_spec(1024, 8, 2000, 4)
    assert s.window_reachable and s.rounds == (1024 - 16,)
    with pytest.raises(ValueError, match="probe pairs"):
        data.probe_spec(1024, data.N_KEYS + 1, 10, 1)


# ------------------------------------------------------------------------------------------------
# model and variants
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("core", ["sdpa", "bsfa"])
def test_tiny_model_overfits_one_batch(corpus, core):
    torch.manual_seed(0)
    L = 128
    attn = SDPACore() if core == "sdpa" else BsfaCore(bsfa.causal() & bsfa.window(16), 32, island=False)
    model = Decoder(data.VOCAB, 32, 1, 2, 1, 16, attn)
    batch = data.TrainStream(corpus, L, 2, data.probe_spec(L, 2, 8, 1), 0.0, seed=0).next()
    cos, sin = rope_tables(L, 16, 10000.0, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        loss, ce, correct = model(batch.tokens, batch.targets, batch.weights, cos, sin, None)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(np.log(data.VOCAB), abs=0.3)  # starts near uniform
    assert losses[-1] < 0.6 * losses[0], losses
    assert ce.shape == (2, L) and correct.dtype == torch.bool


@pytest.mark.parametrize("text", ["causal & longformer(window=20, n_global=5)",
                                  "causal & bigbird(window=16, n_global=8, n_random=2, block=32)",
                                  "causal & (chunked(48) | ~sliding_window(3))", "prefix_lm(10)",
                                  "causal & document"])
def test_flex_mask_mod_equals_mask(text):
    n = 100
    doc = torch.tensor([0] * 30 + [1] * 45 + [2] * 25)
    mask = bsfa.parse(text, document=doc)
    mod = mask_mod_from(mask, n, "cpu")
    q = torch.arange(n).view(n, 1)
    kv = torch.arange(n).view(1, n)
    got = mod(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), q, kv)
    assert torch.equal(got.expand(n, n), mask.to_dense(n, n))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("how", ["layout", "create"])
def test_flex_documents_block_mask_follows_the_batch(corpus, how):
    """The per-batch Flex block mask of the documents variant equals causal & document(ids) (forward,
    against the float64 reference; Flex has no CPU backward)."""
    L = 128
    pats = Patterns(block_size=32)
    v = Variant("flex_documents", L, pats, torch.device("cpu"), compiled=False, heads=2, kv_heads=1, head_dim=16,
                flex_block_mask=how)
    stream = data.TrainStream(corpus, L, 2, data.probe_spec(L, 2, 8, 1), 0.0, seed=5)
    for _ in range(2):
        b = stream.next()
        b.doc[:, L // 2:] += 1  # at least two documents per row
        bm = v.arg(b, b)
        q = torch.randn(2, 2, L, 16)
        k, vv = torch.randn(2, 1, L, 16), torch.randn(2, 1, L, 16)
        with torch.no_grad():
            out = v.core(q, k, vv, bm)
        ref = bsfa.reference_attention(q.double(), k.double(), vv.double(),
                                       mask=bsfa.causal() & bsfa.document(b.doc))
        assert (out.double() - ref).abs().max().item() < 1e-4


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_and_ours_compute_the_same_model(corpus):
    """Same weights, same batch: the Flex and blocksparse_fa variants of every pattern give the same
    per-token losses (forward; the patterns and their Flex translations agree)."""
    L = 256
    pats = Patterns(block_size=32, sliding_window=32, longformer_window=16, longformer_global=32,
                    bigbird_window=16, bigbird_global=32, bigbird_random=1)
    b = data.TrainStream(corpus, L, 2, data.probe_spec(L, 4, 64, 1), 0.5, seed=7).next()
    b.doc[:, L // 3:] += 1
    b.doc[:, 2 * L // 3:] += 1
    cos, sin = rope_tables(L, 16, 1e4, "cpu")
    for fam in ("causal", "sliding", "longformer", "bigbird", "documents"):
        ce = {}
        for impl in ("flex", "bsfa"):
            v = Variant(f"{impl}_{fam}", L, pats, torch.device("cpu"), compiled=False, heads=4, kv_heads=2,
                        head_dim=16)
            torch.manual_seed(0)
            model = Decoder(data.VOCAB, 64, 2, 4, 2, 16, v.core)
            with torch.no_grad():
                ce[impl] = model(b.tokens, b.targets, b.weights, cos, sin, v.arg(b, b))[1]
        assert (ce["flex"] - ce["bsfa"]).abs().max().item() < 1e-4, fam


_BM_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
              "full_q_num_blocks", "full_q_indices")


def _assert_same_block_mask(got, ref, what):
    for name in _BM_FIELDS:
        a, b = getattr(got, name), getattr(ref, name)
        assert a.shape == b.shape and a.dtype == b.dtype, (what, name, a.shape, b.shape, a.dtype, b.dtype)
        assert torch.equal(a, b), (what, name)
    assert got.BLOCK_SIZE == ref.BLOCK_SIZE and tuple(got.seq_lengths) == tuple(ref.seq_lengths), what


@pytest.mark.parametrize("fam", ["causal", "sliding", "longformer", "bigbird"])
@pytest.mark.parametrize("L,bs", [(1024, 64), (2048, 128)])
def test_flex_block_mask_from_layout_equals_create_block_mask(fam, L, bs):
    """Every tensor of the BlockMask built from the pattern's block states (visited and full blocks,
    both directions) equals ``create_block_mask``'s, which evaluates all L x L pairs."""
    pats = Patterns(block_size=bs, sliding_window=300, longformer_window=200, longformer_global=160,
                    bigbird_window=100, bigbird_global=bs, bigbird_random=2)
    mask = pats.mask(fam)
    mod = mask_mod_from(mask, L, "cpu")
    got = block_mask_from_states(layout_block_states(mask, L, bs, "cpu"), bs, mod)
    ref = create_block_mask(mod, None, None, L, L, device="cpu", BLOCK_SIZE=bs)
    _assert_same_block_mask(got, ref, fam)
    assert 0 < got.sparsity() < 100


def test_flex_document_block_mask_equals_create_block_mask():
    """Per-batch document block states from the ids (block id ranges) give create_block_mask's
    BlockMask, with boundaries inside blocks, on block edges, one-token documents and a probe row
    (a single document)."""
    L, bs = 1024, 64
    doc = torch.zeros(3, L, dtype=torch.int32)
    for cut in (100, 128, 129, 300, 301, 512, 700, 1000):  # row 0: many files, some on block edges
        doc[0, cut:] += 1
    for cut in (64, 640):  # row 1: boundaries exactly on block edges only
        doc[1, cut:] += 1
    # row 2: one document (a probe sequence)

    def mod(b, h, q, kv):
        return (kv <= q) & (doc[b, q] == doc[b, kv])

    states = document_block_states(doc, bs)
    assert states.shape == (3, 1, L // bs, L // bs) and states.dtype == torch.int8
    got = block_mask_from_states(states, bs, mod)
    ref = create_block_mask(mod, 3, None, L, L, device="cpu", BLOCK_SIZE=bs)
    _assert_same_block_mask(got, ref, "documents")
    # the same states as the blocksparse_fa layout of causal() & document(ids), row by row
    for b in range(3):
        lay = bsfa.compile_mask(bsfa.causal() & bsfa.document(doc[b]), L, L, bs, cache=False)
        assert torch.equal(states[b, 0], lay.block_states().reshape(L // bs, L // bs)), b
    # unsorted ids: a superset of the visited blocks, full blocks still exact (correct, maybe slower)
    perm = doc[0].clone()
    perm[200:260] = 7
    loose = document_block_states(perm[None], bs)[0, 0]
    exact = bsfa.compile_mask(bsfa.causal() & bsfa.document(perm), L, L, bs, cache=False).block_states()
    exact = exact.reshape(L // bs, L // bs)
    assert ((loose > 0) | (exact == 0)).all()  # every visited block is visited
    assert torch.equal(loose == 2, exact == 2)


def test_flex_setup_does_not_evaluate_the_full_mask(monkeypatch, corpus):
    """At 64K tokens the Flex variants build their block masks from block states: create_block_mask
    (L x L evaluation, or minutes of compilation on CUDA) is never called, neither at setup nor per
    batch."""
    def forbidden(*a, **k):
        raise AssertionError("create_block_mask called")

    monkeypatch.setattr(variants, "create_block_mask", forbidden)
    L, bs = 65536, 128
    pats = Patterns()
    for fam in ("longformer", "bigbird"):
        v = Variant(f"flex_{fam}", L, pats, torch.device("cpu"), compiled=False)
        bm = v.arg(None, None)
        T = L // bs
        assert bm.kv_indices.shape == (1, 1, T, T) and tuple(bm.seq_lengths) == (L, L)
        lay = bsfa.compile_mask(pats.mask(fam), L, L, bs)
        assert int(bm.kv_num_blocks.sum()) == lay.n_partial and int(bm.full_kv_num_blocks.sum()) == lay.n_full
    v = Variant("flex_documents", L, pats, torch.device("cpu"), compiled=False)
    spec = data.probe_spec(L, 16, 8192, 2)
    b = data.TrainStream(corpus, L, 1, spec, 0.0, seed=11).next()
    bm = v.arg(b, b)
    lay = bsfa.compile_mask(bsfa.causal() & bsfa.document(b.doc[0]), L, L, bs, cache=False)
    assert int(bm.kv_num_blocks.sum()) + int(bm.full_kv_num_blocks.sum()) == lay.n_nonempty


# ------------------------------------------------------------------------------------------------
# planning under a deadline
# ------------------------------------------------------------------------------------------------
def test_plan_steps_fits_the_deadline_and_keeps_steps_equal():
    cfg = runner.RunConfig(device="cuda", steps=250, eval_every=25, eval_windows=4, eval_probes=2, profile_steps=3,
                           deadline_reserve=10.0)
    later = [(40.0, 0.4), (40.0, 0.4)]
    # plenty of time: the planned steps
    assert runner.plan_steps(0.5, 0.0, 1000.0, cfg, later, done=5) == 250
    # too little: fewer steps, and the running variant plus the later ones fit in the time left
    n = runner.plan_steps(1.5, 30.0, 540.0, cfg, later, done=5)
    assert 5 < n < 250

    def total(n, step):
        ev = runner.eval_cost_s(cfg, step) / cfg.eval_every
        t = (n - 5) * (step + ev) + runner.tail_s(cfg, step)
        for over, ratio in later:
            t += over + n * step * ratio * (1 + ev / step) + runner.tail_s(cfg, step * ratio, reserve=False)
        return t

    assert total(n, 1.5) <= 540.0 - 30.0 < total(n + 2, 1.5)
    # never fewer than already done, never more than planned
    assert runner.plan_steps(10.0, 500.0, 540.0, cfg, later, done=7) == 7
    assert runner.plan_steps(0.01, 0.0, 1e6, cfg, [], done=0) == 250


def test_estimates_from_measured_variants():
    res = [{"status": "ok", "impl": "sdpa", "seq_len": 65536, "median_step_ms": 500.0, "block_density": 0.5,
            "overhead_s": 20.0},
           {"status": "ok", "impl": "bsfa", "seq_len": 65536, "median_step_ms": 100.0, "block_density": 0.0136,
            "overhead_s": 35.0}]
    assert runner.estimate_step_s(0.0136, "bsfa", 65536, res) == pytest.approx(0.1)
    assert 0.1 < runner.estimate_step_s(0.0175, "bsfa", 65536, res) < 0.15  # a slightly denser pattern
    assert runner.estimate_step_s(0.5, "bsfa", 65536, res) > 0.4  # ours dense: far slower than its sparse
    assert runner.estimate_step_s(0.5, "sdpa", 131072, res) >= 4 * 0.5  # attention grows with L^2
    assert runner.estimate_step_s(0.5, "sdpa", 65536, []) is None
    assert runner.estimate_overhead_s("bsfa", res) == 35.0 and runner.estimate_overhead_s("flex", res) == 35.0
    assert runner.estimate_overhead_s("flex", [], default=45.0) == 45.0


def test_compile_dominated_first_step_does_not_stop_the_variant(monkeypatch, corpus):
    """A first step that takes most of the time left (compilation) is not taken as the step time:
    the variant goes on training until the deadline really comes near (a simulated clock: the
    first step "takes" 100 s, the others 50 ms; 3 s are left after the first)."""
    class Clock:
        t = 1000.0

        def perf_counter(self):
            return self.t

    clock = Clock()
    monkeypatch.setattr(runner, "time", clock)
    orig = runner._Setup.step

    def step(self, i):
        clock.t += 100.0 if i == 0 else 0.05
        return orig(self, i)

    monkeypatch.setattr(runner._Setup, "step", step)
    cfg = runner.RunConfig(device="cpu", seq_len=128, batch=1, layers=1, d_model=32, heads=2, kv_heads=1,
                           head_dim=16, steps=12, warmup=2, eval_every=-1, compile=False, sync_steps=2,
                           profile_steps=0, log_every=0, probe_pairs=4, deadline_reserve=0.5, mode="throughput")
    pats = Patterns(block_size=32, sliding_window=32, longformer_window=16, longformer_global=32,
                    bigbird_window=16, bigbird_global=32, bigbird_random=1)
    r = runner.train_variant("sdpa_causal", cfg, pats, corpus, lambda *a: None, deadline=clock.t + 103.0)
    assert r["status"] == "ok" and r["steps"] == 12 and r["stopped"] == "steps", (r.get("steps"), r.get("stopped"))
    assert r["first_steps_s"][0] == pytest.approx(100.0) and r["compile_s"] == pytest.approx(99.95)
    # ... and the deadline does stop it when the steps after compilation would pass it
    r = runner.train_variant("sdpa_causal", replace(cfg, steps=200), pats, corpus, lambda *a: None,
                             deadline=clock.t + 103.0)
    assert r["status"] == "ok" and r["stopped"] == "deadline" and 30 < r["steps"] < 60, r["steps"]


def test_deadline_caps_and_skips_are_recorded(tmp_path):
    """Under a deadline: the first (core) variant's step count caps every later variant (equal
    steps); a variant whose setup and first steps cannot fit is skipped with the reason, never
    silently dropped."""
    out = tmp_path / "d.json"
    payload = cli.main(["run", *TINY, "--variants", "sdpa_causal,bsfa_longformer,bsfa_sliding", "--steps", "8",
                        "--max-steps", "4", "--eval-every", "2", "--json", str(out)])
    res = {r["variant"]: r for r in payload["results"]}
    for v in ("sdpa_causal", "bsfa_longformer", "bsfa_sliding"):
        r = res[v]
        assert r["status"] == "ok" and r["steps"] == 4 and r["steps_planned"] == 8 and r["stopped"] == "max_steps"
        assert [e["step"] for e in r["evals"]] == [2, 4]
        assert set(r["setup_detail"]) >= {"variant_s", "model_s", "data_s", "eval_data_s"}
        assert r["setup_s"] >= 0 and r["compile_s"] >= 0 and r["overhead_s"] >= r["setup_s"]
    # same initial weights and batches for every variant
    assert abs(res["sdpa_causal"]["train_loss"][0] - res["bsfa_longformer"]["train_loss"][0]) < 0.05
    payload = cli.main(["run", *TINY, "--variants", "sdpa_causal,bsfa_longformer", "--steps", "8",
                        "--deadline", "0.001", "--json", str(out)])
    for r in payload["results"]:
        assert r["status"] == "skipped" and "deadline" in r["reason"] and r["block_density"] > 0
    md = report.markdown(payload, {})
    not_run = md.split("Not run: ", 1)[1].split("\n", 1)[0]
    assert not_run.startswith("sdpa_causal (") and "--deadline" in not_run


# ------------------------------------------------------------------------------------------------
# end to end
# ------------------------------------------------------------------------------------------------
def test_cpu_run_writes_results_and_report(tmp_path):
    out = tmp_path / "r.json"
    docs = tmp_path / "docs"
    payload = cli.main(["run", *TINY, "--variants", "sdpa_causal,bsfa_longformer,flex_longformer", "--steps", "8",
                        "--eval-every", "4", "--lr", "3e-3", "--json", str(out), "--docs", str(docs)])
    saved = json.loads(out.read_text())
    assert saved["schema"] == report.SCHEMA and saved["results"] == json.loads(json.dumps(payload["results"]))
    run = next(iter(saved["runs"].values()))
    assert run["config"]["layers"] == 2 and run["data"]["unigram_entropy_bpb"] > 3
    res = {r["variant"]: r for r in saved["results"]}
    assert res["flex_longformer"]["status"] == "skipped"  # no Flex backward on CPU
    for name in ("sdpa_causal", "bsfa_longformer"):
        r = res[name]
        assert r["status"] == "ok" and r["steps"] == 8 and len(r["train_loss"]) == 8
        assert all(np.isfinite(r["train_loss"]))
        assert r["tokens_per_s"] > 0 and r["median_step_ms"] > 0 and r["compile_s"] >= 0
        assert r["gpu"] is None and r["peak_mem_gb"] is None  # n/a on CPU
        assert [e["step"] for e in r["evals"]] == [4, 8]
        for e in r["evals"]:
            assert 0 < e["bpb"] < 12 and 0 <= e["probe_acc"] <= 1 and e["train_s"] > 0
        assert r["final"] == r["evals"][-1]
        assert r["evals"][-1]["bpb"] < r["evals"][0]["bpb"]  # learning
    # same initial weights and data for every variant
    assert res["sdpa_causal"]["init_checksum"] == res["bsfa_longformer"]["init_checksum"]
    assert abs(res["sdpa_causal"]["train_loss"][0] - res["bsfa_longformer"]["train_loss"][0]) < 0.05
    assert res["bsfa_longformer"]["block_density"] < res["sdpa_causal"]["block_density"]
    md = (docs / "training.md").read_text()
    assert "| blocksparse_fa longformer | ok | 8 |" in md and "## Targets" in md
    assert (docs / "training_curves_256.png").stat().st_size > 1000

    # report: merge with a second file (a throughput run of the same variant wins for its key)
    other = json.loads(out.read_text())
    for r in other["results"]:
        r["mode"] = "throughput"
    other["runs"] = {"other-run": run}
    for r in other["results"]:
        r["run_id"] = "other-run"
    p2 = tmp_path / "r2.json"
    p2.write_text(json.dumps(other))
    merged_path = tmp_path / "merged.json"
    cli.main(["report", str(out), str(p2), "--json", str(merged_path), "--docs", str(docs)])
    merged = json.loads(merged_path.read_text())
    assert len(merged["runs"]) == 2 and len(merged["results"]) == 6
    md = (docs / "training.md").read_text()
    assert "## Throughput" in md and "### 256 tokens" in md
    assert (docs / "training_throughput.png").exists()


def test_targets_are_computed_with_margins():
    def res(variant, tps, bpb=None, busy=None):
        r = {"variant": variant, "impl": variant.split("_")[0], "family": variant.split("_", 1)[1],
             "seq_len": 65536, "mode": "train", "status": "ok", "tokens_per_s": tps, "run_id": "x",
             "gpu": {"busy_fraction": busy, "device_ms_per_step": 1.0, "wall_ms_per_step": 1.0} if busy else None}
        if bpb is not None:
            r["evals"] = [{"step": 100, "bpb": bpb}]
            r["final"] = r["evals"][0]
        return r

    cfg = {"layers": 8, "d_model": 1024, "heads": 8, "kv_heads": 2, "head_dim": 128}
    payload = {"schema": report.SCHEMA,
               "runs": {"x": {"config": cfg, "env": {"device": "NVIDIA H100 80GB HBM3"},
                              "data": {"unigram_heldout_bpb": 4.7}}},
               "results": [res("sdpa_causal", 100.0, 2.0), res("flex_longformer", 250.0),
                           res("bsfa_longformer", 280.0, 2.1, 0.95), res("bsfa_sliding", 500.0, 2.04, 0.8)]}
    t = {x["target"]: x for x in report.targets(payload)}
    vs_sdpa = t["blocksparse_fa Longformer vs SDPA dense causal, tokens/s >= 3.0x"]
    assert vs_sdpa["met"] is False and "missed by 7%" in vs_sdpa["detail"]
    assert t["blocksparse_fa Longformer vs Flex Longformer, tokens/s >= 1.3x"]["met"] is False
    assert t["GPU busy >= 90 %: bsfa_longformer"]["met"] is True
    assert t["GPU busy >= 90 %: bsfa_sliding"]["met"] is False
    assert t["dense model learns: held-out bits/byte far below the unigram entropy"]["met"] is True
    assert t["held-out bits/byte at most 3 % above dense: bsfa_longformer"]["met"] is False  # +5 %
    assert t["held-out bits/byte at most 3 % above dense: bsfa_sliding"]["met"] is True  # +2 %


# ------------------------------------------------------------------------------------------------
# context parallelism (one rank here; tests/test_cp_integration.py runs two)
# ------------------------------------------------------------------------------------------------
def test_cp_command_one_rank(tmp_path, corpus):
    out = tmp_path / "cp.json"
    payload = cli.main(["cp", "--device", "cpu", "--pattern", "bigbird", "--seq-len", "128", "--steps", "3",
                        "--batch", "1", "--layers", "1", "--d-model", "32", "--heads", "4", "--kv-heads", "2",
                        "--block-size", "16", "--bigbird-window", "16", "--bigbird-global", "16",
                        "--bigbird-random", "1", "--sync-steps", "1", "--json", str(out), "--quiet"])
    saved = json.loads(out.read_text())
    assert saved["world_size"] == 1 and saved["pattern"] == "bigbird"
    assert len(saved["losses"]) == 3 and all(np.isfinite(saved["losses"])) and saved["losses"][0] > 1.0
    assert saved["tokens_per_s"] > 0 and saved["timed_steps"] == 2
    assert saved["per_rank"][0]["tokens"] == 128 and saved["per_rank"][0]["peak_rss_gb"] > 0
    assert payload["losses"] == saved["losses"]
    with pytest.raises(SystemExit):
        cli.main(["cp", "--device", "cpu", "--seq-len", "100", "--block-size", "16", "--quiet"])
