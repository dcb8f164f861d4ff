"""Sampling: the KV-cached decode against full forwards, the sampling rules on fixed distributions, and a small
model that learned a string writing it back."""

from __future__ import annotations

import pytest
import torch

from attention import why_not_decode
from model import ModelConfig, TransformerLM
from model.generation import Decoder, Sampling, generate, probabilities, sample


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny(attn: str = "naive", device: str = "cpu", **kw) -> TransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(**{"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 128, "vocab_size": 50,
                         "context_length": 64, **kw})
    return TransformerLM(cfg, attn).eval().to(device)


def decode_available(attn: str) -> None:
    q = torch.zeros(1, 1, 1, 16, device=DEVICE)
    k = torch.zeros(1, 1, 128, 16, device=DEVICE)
    if (reason := why_not_decode(attn, q, k, k, 1)) is not None:
        pytest.skip(reason)


# Each case takes seconds (flash's in the interpreter); sdpa's stays in the default run.
@pytest.mark.parametrize("attn", [pytest.param(a, marks=[] if a == "sdpa" else pytest.mark.slow)
                                  for a in ("naive", "sdpa", "flash-torch", "flash")])
def test_every_decode_step_equals_a_full_forward(attn):
    """Ragged prompts in one batch: each step's logits are those of the model over that sequence's whole prefix."""
    decode_available(attn)
    model = tiny(attn, DEVICE)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [2, 7], [1, 8, 2, 8]]
    steps = 5
    decoder = Decoder(model, batch=3, max_len=16)
    ids = torch.zeros(3, 7, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    logits = decoder.prefill(ids.to(DEVICE), torch.tensor([len(p) for p in prompts], device=DEVICE))
    seqs = [list(p) for p in prompts]
    gen = torch.Generator().manual_seed(0)
    for step in range(steps + 1):
        with torch.no_grad():
            for i, s in enumerate(seqs):
                full = model(torch.tensor([s], device=DEVICE))[0, -1]
                torch.testing.assert_close(logits[i], full, atol=1e-5, rtol=1e-5, msg=f"step {step}, row {i}")
        if step == steps:
            break
        tokens = torch.randint(0, 50, (3,), generator=gen)
        for s, t in zip(seqs, tokens.tolist()):
            s.append(t)
        logits = decoder.step(tokens.to(DEVICE)).clone()


def test_the_training_forward_is_unchanged_without_a_cache():
    model = tiny()
    ids = torch.randint(0, 50, (2, 10))
    with torch.no_grad():
        loss = model(ids, targets=ids)
        logits = model(ids)
    assert logits.shape == (2, 10, 50) and loss.dim() == 0


def test_greedy_is_deterministic_and_is_the_argmax():
    model = tiny()
    a = generate(model, [[1, 2, 3]], 10, Sampling(temperature=0)).tokens
    b = generate(model, [[1, 2, 3]], 10, Sampling(temperature=0)).tokens
    assert a == b and len(a[0]) == 10
    seq = [1, 2, 3]
    with torch.no_grad():
        for t in a[0]:
            assert model(torch.tensor([seq]))[0, -1].argmax().item() == t
            seq.append(t)


def test_a_seed_reproduces_samples():
    model = tiny()
    s = Sampling(temperature=1.0, top_k=20, top_p=0.9)
    runs = [generate(model, [[1, 2]] * 3, 12, s, torch.Generator().manual_seed(seed)).tokens for seed in (0, 0, 1)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


FIXED = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])


def test_temperature_divides_the_logits():
    torch.testing.assert_close(probabilities(FIXED, Sampling(temperature=2.0)), torch.softmax(FIXED / 2, -1))
    assert probabilities(FIXED, Sampling(temperature=0)).tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]


def test_top_k_keeps_the_k_most_likely():
    p = probabilities(FIXED, Sampling(top_k=2))
    torch.testing.assert_close(p, torch.tensor([[1, torch.e ** -1, 0, 0, 0]]) / (1 + torch.e ** -1))
    tied = probabilities(torch.tensor([[1.0, 1.0, 1.0, 0.0]]), Sampling(top_k=2))  # ties with the k-th stay
    torch.testing.assert_close(tied, torch.tensor([[1 / 3, 1 / 3, 1 / 3, 0.0]]))


def test_top_p_keeps_the_smallest_set_reaching_p():
    full = torch.softmax(FIXED, -1)  # 0.644, 0.237, 0.087, 0.032, ~0
    for top_p, kept in [(0.5, 1), (0.64, 1), (0.65, 2), (0.88, 2), (0.9, 3), (1.0, 5)]:
        p = probabilities(FIXED, Sampling(top_p=top_p))
        expected = torch.zeros_like(full)
        expected[0, :kept] = full[0, :kept] / full[0, :kept].sum()
        torch.testing.assert_close(p, expected, msg=f"top_p {top_p}")


def test_sample_follows_the_distribution():
    gen = torch.Generator().manual_seed(0)
    draws = sample(FIXED.expand(20_000, -1), Sampling(top_k=3), gen)
    freq = torch.bincount(draws, minlength=5).float() / draws.numel()
    torch.testing.assert_close(freq, probabilities(FIXED, Sampling(top_k=3))[0], atol=0.01, rtol=0)


@pytest.mark.slow  # a long generation
def test_generation_stops_at_the_context():
    model = tiny()
    out = generate(model, [[1] * 60, [2] * 10], 20, Sampling(temperature=0))
    assert out.hit_context and [len(t) for t in out.tokens] == [4, 20]


@pytest.mark.slow  # 150 training steps
def test_a_trained_model_writes_its_string_back():
    text = b"the quick brown fox jumps over the lazy dog. "
    data = torch.tensor(list(text * 40))
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=256, vocab_size=256,
                                      context_length=64), "sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        starts = torch.randint(0, len(data) - 65, (16,), generator=gen)
        batch = torch.stack([data[s:s + 65] for s in starts.tolist()])
        loss = model(batch[:, :-1], targets=batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    out = generate(model, [list(b"the quick ")], 40, Sampling(temperature=0)).tokens[0]
    assert bytes(out) == (text * 2)[len(b"the quick "):][:40]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph of the compiled decode step needs CUDA")
@pytest.mark.parametrize("attn", ["sdpa", "flash"])
def test_the_compiled_and_graphed_step_equals_the_eager_one(attn):
    model = tiny(attn, "cuda")
    prompts = [[3, 1, 4, 1, 5], [2, 7]]
    eager = generate(model, prompts, 12, Sampling(temperature=0))
    compiled = generate(model, prompts, 12, Sampling(temperature=0), compile=True)
    assert compiled.tokens == eager.tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph of the compiled decode step needs CUDA")
def test_a_compiled_step_costs_the_same_whatever_the_cache_can_hold():
    """The step writes one position in place: a cache 64x longer, of which the same 16 positions are used, takes no
    longer. (A compiled step that wrote into views of one shared buffer copied that buffer, 1 GiB here, every
    step.)"""
    decode_available("flash")
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=512, n_layers=2, n_heads=8, d_ff=1024, vocab_size=50, context_length=32768)
    model = TransformerLM(cfg, "flash").eval().to("cuda", torch.bfloat16)
    ids = torch.randint(0, 50, (8, 16), device="cuda")

    def step_ms(max_len: int) -> float:
        decoder = Decoder(model, batch=8, max_len=max_len, compile=True)
        tokens = decoder.prefill(ids, torch.full((8,), 16, device="cuda")).argmax(-1)
        for _ in range(3):  # compiles, then captures
            tokens = decoder.step(tokens).argmax(-1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            decoder.step(tokens)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 20

    short, long = step_ms(512), step_ms(32768)
    assert long < 1.5 * short + 0.05, f"{long:.3f} ms a step with a cache of 32768 against {short:.3f} with 512"


@pytest.mark.slow  # a decode of each backend (the plain decode's sdpa case stays in the default run)
@pytest.mark.parametrize("attn", ["naive", "sdpa", "flash-torch", "flash"])
def test_decoding_a_model_with_gqa_windows_and_softcap_equals_its_full_forward(attn):
    """Sampling runs the variants of training: a cache of the key/value heads, the local layers' window, softcap,
    QK-norm, the ReLU² MLP and the logit softcap."""
    variants = {"n_kv_heads": 2, "window": 4, "window_pattern": "LG", "qk_norm": True, "mlp": "relu2",
                "logit_softcap": 15.0}
    if attn != "sdpa":  # SDPA takes no softcap
        variants["attn_softcap"] = 20.0
    decode_available(attn)
    model = tiny(attn, DEVICE, **variants)
    decoder = Decoder(model, batch=2, max_len=16)
    assert decoder.cache.keys_values(0)[0].shape[1] == 2  # kv heads, not 4
    prompts = [[3, 1, 4, 1, 5, 9, 2], [2, 7]]
    ids = torch.zeros(2, 7, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    logits = decoder.prefill(ids.to(DEVICE), torch.tensor([len(p) for p in prompts], device=DEVICE))
    seqs = [list(p) for p in prompts]
    for step in range(4):
        with torch.no_grad():
            for i, s in enumerate(seqs):
                full = model(torch.tensor([s], device=DEVICE))[0, -1]
                torch.testing.assert_close(logits[i], full, atol=1e-5, rtol=1e-5, msg=f"step {step}, row {i}")
        tokens = torch.tensor([step + 1, step + 2])
        for s, t in zip(seqs, tokens.tolist()):
            s.append(t)
        logits = decoder.step(tokens.to(DEVICE)).clone()
