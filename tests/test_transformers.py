"""Hugging Face integration: a tiny Llama built from a config (no downloads) running on our attention
matches the same model (same weights) on SDPA: logits and gradients, with and without padding."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import rel_err

transformers = pytest.importorskip("transformers")

from blocksparse_fa.integrations.transformers import key_padding_ids, register, unregister  # noqa: E402


@pytest.fixture(scope="module")
def registered():
    register("causal", block_size=16)
    register("sliding_window(8)", name="bsfa_sw8", block_size=16)
    yield
    unregister("blocksparse")
    unregister("bsfa_sw8")


def tiny_config():
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                    max_position_embeddings=256, initializer_range=0.2)


def model_pair(impl, dtype):
    cfg = tiny_config()
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa", dtype=dtype)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == impl and ref.config._attn_implementation == "sdpa"
    return ref, ours


def logits_and_grads(model, ids, attention_mask, labels):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=attention_mask, labels=labels)
    out.loss.backward()
    return out.logits.detach(), [p.grad.detach().clone() for p in model.parameters()]


def batch(padded: bool, L=50):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, L), generator=g)
    if not padded:
        return ids, None, ids.clone()
    am = torch.ones(2, L, dtype=torch.long)
    am[0, L - 10:] = 0  # right padding
    am[1, :7] = 0  # left padding
    valid = am.bool()
    scored = valid.clone()
    scored[:, 1:] &= valid[:, :-1]  # a label is scored when it and the position predicting it are real
    return ids, am, torch.where(scored, ids, torch.full_like(ids, -100))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("padded", [False, True], ids=["no_padding", "padded"])
def test_causal_pattern_matches_sdpa(registered, dtype, tol, padded):
    ref, ours = model_pair("blocksparse", dtype)
    ids, am, labels = batch(padded)
    la, ga = logits_and_grads(ref, ids, am, labels)
    lb, gb = logits_and_grads(ours, ids, am, labels)
    valid = torch.ones(2, ids.shape[1], dtype=torch.bool) if am is None else am.bool()
    assert rel_err(lb[valid], la[valid]) < tol
    for a, b in zip(ga, gb):
        assert rel_err(b, a) < tol * 10
    assert la.abs().max() > 1  # the comparison is not between near-zero logits


def test_pattern_is_applied(registered):
    """The sliding-window pattern equals SDPA given the same mask explicitly, and differs from causal."""
    ref, ours = model_pair("bsfa_sw8", torch.float64)
    ids, _, labels = batch(False, L=40)
    i = torch.arange(40)
    sw = ((i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] < 8))[None, None].expand(2, 1, 40, 40)
    la, ga = logits_and_grads(ref, ids, sw, labels)  # SDPA with an explicit 4D mask
    lb, gb = logits_and_grads(ours, ids, None, labels)  # ours: pattern & causal
    assert rel_err(lb, la) < 1e-12
    for a, b in zip(ga, gb):
        assert rel_err(b, a) < 1e-10
    lc, _ = logits_and_grads(ref, ids, None, labels)  # plain causal SDPA
    assert rel_err(lc, la) > 1e-2


def test_user_4d_mask_is_used_exactly(registered):
    """A 4D boolean mask (here causal & a per-batch random key drop) goes the dense path and matches SDPA."""
    ref, ours = model_pair("blocksparse", torch.float64)
    ids, _, labels = batch(False, L=40)
    g = torch.Generator().manual_seed(3)
    i = torch.arange(40)
    keep = (i[:, None] >= i[None, :])[None, None] & (torch.rand(2, 1, 1, 40, generator=g) > 0.3)
    keep = keep | torch.eye(40, dtype=torch.bool)  # no empty rows
    la, _ = logits_and_grads(ref, ids, keep, labels)
    lb, _ = logits_and_grads(ours, ids, keep, labels)
    assert rel_err(lb, la) < 1e-12
    additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)
    lc, _ = logits_and_grads(ours, ids, additive, labels)
    assert rel_err(lc, la) < 1e-12


def test_generate_with_cache_and_left_padding_matches_sdpa(registered):
    """Prefill + cached decoding (queries bottom-right aligned with the cache) with a left-padded batch."""
    ref, ours = model_pair("blocksparse", torch.float64)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 128, (2, 20), generator=g)
    am = torch.ones(2, 20, dtype=torch.long)
    am[1, :6] = 0
    kw = dict(attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0)
    a, b = ref.generate(ids, **kw), ours.generate(ids, **kw)
    assert torch.equal(a, b)


def test_gemma2_softcap_matches_eager(registered):
    """Gemma 2 passes ``softcap=`` (attn_logit_softcapping) to the attention function: it runs as the
    fused soft-cap and matches the model's eager attention (which takes its softmax in float32);
    the same model without the soft-cap gives other logits."""
    cfg = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256,
                                    attn_logit_softcapping=0.5, final_logit_softcapping=None, sliding_window=8,
                                    query_pre_attn_scalar=16, initializer_range=0.2)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager",
                                                        dtype=torch.float32)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="blocksparse",
                                                         dtype=torch.float32)
    ours.load_state_dict(ref.state_dict())
    ids, _, labels = batch(False, L=40)
    la, ga = logits_and_grads(ref, ids, None, labels)
    lb, gb = logits_and_grads(ours, ids, None, labels)
    assert rel_err(lb, la) < 1e-5
    for a, b in zip(ga, gb):
        assert rel_err(b, a) < 1e-4
    for layer in ref.model.layers:  # the reference without its soft-cap
        layer.self_attn.attn_logit_softcapping = None
    lc, _ = logits_and_grads(ref, ids, None, labels)
    assert rel_err(lc, la) > 1e-2


def test_register_score_mod_for_every_layer():
    """``register(score_mod=)``: ALiBi on every layer of a Llama equals the eager model with the same
    biases given as an additive 4D mask; context parallelism refuses it."""
    import blocksparse_fa as bsfa

    H, L = 4, 30
    slopes = bsfa.alibi_slopes(H).double()
    register("causal", name="bsfa_alibi", block_size=16, score_mod=bsfa.alibi(slopes))
    try:
        ref, ours = model_pair("bsfa_alibi", torch.float64)
        ids, _, labels = batch(False, L=L)
        i = torch.arange(L)
        alibi = slopes.view(1, H, 1, 1) * (i.view(1, -1) - i.view(-1, 1))
        additive = alibi.masked_fill(i.view(1, -1) > i.view(-1, 1), float("-inf")).expand(2, H, L, L)
        la, _ = logits_and_grads(ref, ids, additive, labels)  # SDPA with the ALiBi biases as its float mask
        lb, _ = logits_and_grads(ours, ids, None, labels)
        assert rel_err(lb, la) < 1e-12
    finally:
        unregister("bsfa_alibi")
    with pytest.raises(NotImplementedError, match="context parallelism"):
        register("causal", name="bsfa_cp", context_parallel=object(), score_mod=bsfa.softcap(2.0))


def test_key_padding_ids():
    valid = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    ids = key_padding_ids(valid)
    assert (ids[valid] == 0).all()
    for row in ids:  # padded keys get pairwise distinct, non-zero ids
        pads = row[row != 0]
        assert len(pads.unique()) == len(pads)
    assert (ids[0].diff() >= 0).all() and (ids[1].diff() >= 0).all()  # left/right padding stay sorted


def test_register_validates_name():
    with pytest.raises(ValueError, match="name"):
        register("causal", name="org/kernel")
