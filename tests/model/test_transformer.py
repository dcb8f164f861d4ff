import pytest
import torch
import torch.nn.functional as F

from model import PRESETS, ModelConfig, TransformerLM, config_for
from training.metrics import flops_per_token, non_embedding_params

TINY = dict(d_model=64, n_layers=2, n_heads=4, d_ff=96, vocab_size=97, context_length=24)


def test_forward_shapes_and_no_biases():
    model = TransformerLM(ModelConfig(**TINY))
    ids = torch.randint(0, 97, (3, 24))
    assert model(ids).shape == (3, 24, 97)
    assert not [n for n, _ in model.named_parameters() if "bias" in n]


def test_model_is_causal():
    """Changing a later token never changes the logits of an earlier one."""
    model = TransformerLM(ModelConfig(**TINY))
    ids = torch.randint(0, 97, (1, 24))
    changed = ids.clone()
    changed[0, 15] = (ids[0, 15] + 1) % 97
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :15], b[:, :15])
    assert not torch.allclose(a[:, 15:], b[:, 15:])


# The compiled backends compile (seconds on a CPU): they run with -m slow.
@pytest.mark.parametrize("attn", ["naive", pytest.param("compiled", marks=pytest.mark.slow),
                                  pytest.param("flex", marks=pytest.mark.slow)])
def test_attention_backend_is_chosen_by_name(attn):
    # Context 32, not TINY's 24: FlexAttention's compiled CPU kernel (torch 2.13) returned NaN at seq 24 with d_head
    # 16 on an AMD EPYC CPU, and was right at seq 8, 32, 48, 64, 65 and 100: a PyTorch bug, not the registry's.
    shape = {**TINY, "context_length": 32}
    torch.manual_seed(0)
    ref = TransformerLM(ModelConfig(**shape), "sdpa")
    other = TransformerLM(ModelConfig(**shape), attn)
    assert (ref.attn, other.attn) == ("sdpa", attn)
    assert all(block.attn.attn_name == attn for block in other.blocks)
    other.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 97, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(other(ids), ref(ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attn", ["sdpa", "flash"])
def test_attention_saves_no_view_of_the_qkv_projection_and_merges_heads_in_place(attn):
    """What a block keeps for backward: v on its own storage, and the out-projection's input a view of o."""
    from tests.conftest import DEVICE

    torch.manual_seed(0)
    attention = TransformerLM(ModelConfig(**TINY), attn).to(DEVICE).blocks[0].attn
    seen = {}
    # The hook holds the qkv output itself, so its address cannot be reused by a later tensor while we compare.
    attention.qkv.register_forward_hook(
        lambda m, i, out: seen.update(qkv_tensor=out, qkv=out.untyped_storage().data_ptr()))
    attention.out.register_forward_pre_hook(lambda m, i: seen.update(out_in=i[0].untyped_storage().data_ptr()))
    attend = attention.attend
    attention.attend = lambda *a, **kw: (o := attend(*a, **kw), seen.update(o=o.untyped_storage().data_ptr()))[0]
    saved = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    x = torch.randn(2, 24, TINY["d_model"], device=DEVICE, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention(x).sum().backward()
    assert seen["qkv"] not in saved, "a view of the fused qkv output was saved: it keeps q, k and v alive"
    assert seen["out_in"] == seen["o"], "merging the heads copied o"


def test_targets_give_the_mean_cross_entropy_of_the_logits():
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(**TINY))
    ids, targets = torch.randint(0, 97, (3, 24)), torch.randint(0, 97, (3, 24))
    loss = model(ids, targets)
    assert loss.shape == () and loss.dtype == torch.float32
    want = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the loss stays fp32 under autocast
        assert model(ids, targets).dtype == torch.float32


def fp32_residual_loss(model: TransformerLM, ids, targets, doc_ids=None) -> torch.Tensor:
    """The model's loss with the residual stream kept in fp32 (autocast's own behaviour: the sublayers' low-precision
    outputs are added to fp32): the reference that the residual stream in autocast's dtype is measured against."""
    x = model.embed(ids)
    angles = model.document_rope_angles(doc_ids) if doc_ids is not None else None
    for block in model.blocks:
        x = x + block.attn(block.attn_norm(x), None, doc_ids, angles)
        x = x + block.ffn(block.ffn_norm(x))
    return model.loss_from_hidden(x, targets)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "documents"])
def test_residual_in_the_autocast_dtype_rounds_only_the_residual_stream(packed):
    """Under bf16 autocast the blocks take and return bf16, and the loss and gradients stay those of an fp32
    residual stream up to bf16 rounding; without autocast the residual stream is fp32, bit for bit."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(**TINY))
    ids, targets = torch.randint(0, 97, (3, 24)), torch.randint(0, 97, (3, 24))
    doc_ids = torch.randint(0, 3, (3, 24)).sort(dim=-1).values if packed else None
    torch.testing.assert_close(model(ids, targets, doc_ids=doc_ids), fp32_residual_loss(model, ids, targets, doc_ids),
                               rtol=0, atol=0)

    seen = []
    model.blocks[1].register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
    losses, grads = [], []
    for loss_of in (fp32_residual_loss, TransformerLM.__call__):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model, ids, targets, doc_ids=doc_ids)
        loss.backward()
        losses.append(loss)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    assert seen == [(torch.bfloat16, torch.bfloat16)]  # the model's own forward (the reference calls no block)
    assert losses[1].dtype == torch.float32
    # The two differ by the rounding of the residual stream to bf16 (8 mantissa bits), not by more.
    assert not torch.equal(losses[0], losses[1])
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-3, atol=0)
    assert F.cosine_similarity(grads[0], grads[1], dim=0) > 0.999


def test_sequence_longer_than_context_is_rejected():
    model = TransformerLM(ModelConfig(**TINY))
    with pytest.raises(ValueError, match="exceeds context_length 24"):
        model(torch.zeros(1, 25, dtype=torch.long))


def test_small_preset_has_the_reference_parameter_count():
    # Hugging Face's Llama with these dims, vocab 10000 and untied head has 128.6M (ANCHORS.md).
    cfg = config_for("small")
    with torch.device("meta"):
        model = TransformerLM(cfg)
    assert model.num_params() == 128_625_408
    assert model.num_params(non_embedding=True) == non_embedding_params(cfg)


def test_presets_and_overrides():
    assert {"small", "medium", "large", "xl", "2.7B", "10B"} <= set(PRESETS)
    cfg = config_for("large", vocab_size=256, n_kv_heads=None)
    assert (cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.n_heads, cfg.vocab_size, cfg.kv_heads) == (1280, 5120, 36, 20,
                                                                                                 256, 20)
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        config_for("huge")


def test_bad_dims_name_the_problem():
    with pytest.raises(ValueError, match=r"d_model \(100\) must be divisible by n_heads \(3\)"):
        ModelConfig(d_model=100, n_heads=3)


def test_flops_per_token_formula():
    cfg = config_for("small", context_length=1024)
    assert flops_per_token(cfg) == 6 * non_embedding_params(cfg) + 12 * 12 * 768 * 1024


def reference_attention(attention, x: torch.Tensor) -> torch.Tensor:
    """CausalSelfAttention's forward written out in x's dtype: projections, RoPE, QK-norm (each head's q and k over
    their RMS, no gain), causal softmax attention, output projection."""
    b, s, _ = x.shape
    h, kv, d = attention.n_heads, attention.n_kv_heads, attention.qkv.weight.shape[1] // attention.n_heads
    q, k, v = (x @ attention.qkv.weight.T).split([h * d, kv * d, kv * d], dim=-1)
    q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, d_head)
    q, k = attention.rope(q), attention.rope(k)
    if attention.qk_norm:
        q, k = (t / t.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() for t in (q, k))
    scores = q @ k.repeat_interleave(h // kv, dim=1).transpose(-1, -2) / d ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    o = scores.softmax(-1) @ v.repeat_interleave(h // kv, dim=1)
    return o.transpose(1, 2).reshape(b, s, h * d) @ attention.out.weight.T


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_attention_with_and_without_qk_norm_against_float64(qk_norm, n_kv_heads):
    attention = TransformerLM(ModelConfig(**TINY, qk_norm=qk_norm, n_kv_heads=n_kv_heads)).blocks[0].attn.double()
    x = torch.randn(2, 24, 64, dtype=torch.float64)
    # Tolerance above float64's: the RoPE tables hold fp32 values.
    torch.testing.assert_close(attention(x), reference_attention(attention, x), atol=1e-6, rtol=1e-5)


def test_qk_norm_bounds_the_scores_whatever_the_weights():
    """With unit-RMS q and k a score is at most sqrt(d_head): scaled-up q/k weights no longer sharpen attention."""
    torch.manual_seed(0)
    plain, normed = (TransformerLM(ModelConfig(**TINY, qk_norm=flag)).blocks[0].attn for flag in (False, True))
    normed.load_state_dict(plain.state_dict())
    x = torch.randn(1, 24, 64)
    before = normed(x)
    for attention in (plain, normed):
        with torch.no_grad():
            attention.qkv.weight[:128] *= 100  # q and k rows
    torch.testing.assert_close(normed(x), before, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(plain(x), before, atol=1e-2)


def test_relu2_mlp_against_float64():
    from model.layers import ReLUSquared

    model = TransformerLM(ModelConfig(**TINY, mlp="relu2")).double()
    mlp = model.blocks[0].ffn
    assert isinstance(mlp, ReLUSquared) and not hasattr(mlp, "w3")
    x = torch.randn(3, 5, 64, dtype=torch.float64)
    torch.testing.assert_close(mlp(x), (x @ mlp.w1.weight.T).clamp(min=0).pow(2) @ mlp.w2.weight.T)
    assert model.num_params(non_embedding=True) == non_embedding_params(model.cfg)  # two matrices counted


def test_zero_init_residual_starts_every_block_as_the_identity():
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(**TINY, zero_init_residual=True))
    x = torch.randn(2, 24, 64)
    for block in model.blocks:
        assert not block.attn.out.weight.any() and not block.ffn.w2.weight.any()
        torch.testing.assert_close(block(x), x)
    assert model.blocks[0].attn.qkv.weight.std() > 0  # the rest keeps its init


def test_logit_softcap_bounds_the_logits():
    torch.manual_seed(0)
    plain, capped = (TransformerLM(ModelConfig(**TINY, logit_softcap=cap)).double() for cap in (None, 2.0))
    capped.load_state_dict(plain.state_dict())
    with torch.no_grad():
        plain.lm_head.weight.mul_(50)
        capped.lm_head.weight.mul_(50)
    ids = torch.randint(0, 97, (2, 24))
    z, logits = plain(ids), capped(ids)
    assert z.abs().max() > 10 and logits.abs().max() <= 2
    torch.testing.assert_close(logits, 2.0 * torch.tanh(z / 2.0))
    loss = capped(ids, ids)  # in fp32, as training computes it
    torch.testing.assert_close(loss.double(), F.cross_entropy(logits.flatten(0, 1), ids.flatten()), rtol=1e-6, atol=0)


@pytest.mark.parametrize("cap", [0.0, -15.0])
def test_a_logit_softcap_out_of_range_says_so(cap):
    with pytest.raises(ValueError) as e:
        ModelConfig(**TINY, logit_softcap=cap)
    assert str(e.value) == f"logit_softcap must be > 0, got {cap}"


def test_an_unknown_mlp_names_the_choices():
    with pytest.raises(ValueError, match="mlp must be one of swiglu, relu2, got 'gelu'"):
        ModelConfig(mlp="gelu")


@pytest.mark.parametrize("attn", ["naive", "flash", pytest.param("flex", marks=pytest.mark.slow)])
def test_the_recipe_options_run_on_every_backend_as_on_sdpa(attn):
    """QK-norm, the ReLU² MLP and the logit softcap live outside attention: every backend computes the same model."""
    from tests.conftest import DEVICE

    shape = {**TINY, "context_length": 32, "qk_norm": True, "mlp": "relu2", "zero_init_residual": True,
             "logit_softcap": 15.0}
    torch.manual_seed(0)
    ref = TransformerLM(ModelConfig(**shape), "sdpa").to(DEVICE)
    for block in ref.blocks:  # zero-initialised projections would hide attention entirely
        torch.nn.init.normal_(block.attn.out.weight, std=0.1)
        torch.nn.init.normal_(block.ffn.w2.weight, std=0.1)
    other = TransformerLM(ModelConfig(**shape), attn).to(DEVICE)
    other.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 97, (2, 32), device=DEVICE)
    tol = 1e-4 if DEVICE == "cpu" else 2e-3  # a GPU's fp32 attention kernels may round their matmuls' inputs to tf32
    with torch.no_grad():
        torch.testing.assert_close(other(ids), ref(ids), atol=tol, rtol=tol)
