"""training/optim/adamw_bf16.py (`--optimizer adamw-bf16`): torch's AdamW update with bf16 moments, weight copies
and the clipping coefficient folded into the update."""

import copy
import os

import pytest
import torch

from model import TransformerLM, config_for
from model.layers import Linear
from tests.training.resolved import resolved
from training.optim import adamw_bf16, get_optimizer
from training.optim.adamw_bf16 import AdamW
from training.step import build_step

CUDA = torch.cuda.is_available()
BETAS, EPS = (0.9, 0.95), 1e-8


def params_and_grads(steps: int, shapes=((33, 17), (17,), (4, 5, 6)), device: str = "cpu"):
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    grads = [[torch.randn(s, device=device) * 10 ** torch.empty(()).uniform_(-3, 1).item() for s in shapes]
             for _ in range(steps)]
    return params, grads


def run(optimizer: torch.optim.Optimizer, params, grads, **step_kwargs) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step(**step_kwargs)


def clone(params) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
def test_fp32_state_gives_torch_adamws_steps(weight_decay, lr_kind):
    params, grads = params_and_grads(6)
    ours, theirs = clone(params), clone(params)
    lr = 3e-3 if lr_kind == "float" else torch.tensor(3e-3)
    run(AdamW(ours, lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay, state_dtype=torch.float32), ours, grads)
    run(torch.optim.AdamW(theirs, lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay, foreach=False),
        theirs, grads)
    for p, q, p0 in zip(ours, theirs, params):
        assert not torch.equal(p, p0)
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_bf16_state_is_the_float64_update_with_moments_rounded_to_bf16():
    params, grads = params_and_grads(5)
    lr, wd = 1e-2, 0.1
    opt = AdamW(params, lr=lr, betas=BETAS, eps=EPS, weight_decay=wd)
    b1, b2 = BETAS
    for t, step_grads in enumerate(grads, start=1):
        before = [(p.detach().double(), opt.state[p]["exp_avg"].double() if t > 1 else torch.zeros_like(p).double(),
                   opt.state[p]["exp_avg_sq"].double() if t > 1 else torch.zeros_like(p).double()) for p in params]
        run(opt, params, [step_grads])
        for p, g, (p0, m0, v0) in zip(params, step_grads, before):
            g = g.double()
            m, v = b1 * m0 + (1 - b1) * g, b2 * v0 + (1 - b2) * g * g
            want = p0 * (1 - lr * wd) - lr / (1 - b1 ** t) * m / (v.sqrt() / (1 - b2 ** t) ** 0.5 + EPS)
            state = opt.state[p]
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
            assert p.dtype == torch.float32 and state["step"].item() == t
            torch.testing.assert_close(p.detach().double(), want, rtol=2e-6, atol=1e-7)
            # Rounded once, from fp32: within half a bf16 unit of the exact moment (plus fp32's own error).
            for got, exact in ((state["exp_avg"], m), (state["exp_avg_sq"], v)):
                torch.testing.assert_close(got.double(), exact, rtol=2 ** -8 + 1e-6, atol=1e-30)


def test_a_clipping_coefficient_is_the_step_of_scaled_gradients():
    params, grads = params_and_grads(3)
    scaled, plain = clone(params), clone(params)
    scale = torch.tensor(0.37)
    run(AdamW(scaled, lr=1e-2), scaled, grads, clip_coef=scale)
    run(AdamW(plain, lr=1e-2), plain, [[g * scale for g in step] for step in grads])
    for p, q in zip(scaled, plain):
        assert torch.equal(p, q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_step_rewrites_the_weight_copies(dtype):
    params, grads = params_and_grads(2)
    copies = {params[0]: params[0].detach().to(dtype), params[2]: params[2].detach().to(dtype)}
    stale = {id(p): c.clone() for p, c in copies.items()}
    run(AdamW(params, lr=1e-2, weight_copies=copies), params, grads)
    for p, low in copies.items():
        assert low.dtype == dtype and torch.equal(low, p.detach().to(dtype))
        assert not torch.equal(low, stale[id(p)])


def test_state_dicts_keep_bf16_moments_and_load_to_and_from_torch_adamw():
    params, grads = params_and_grads(4)
    ours, theirs, restored = clone(params), clone(params), clone(params)
    opt = AdamW(ours, lr=1e-2, weight_decay=0.1)
    run(opt, ours, grads[:2])
    saved = opt.state_dict()
    assert saved["state"][0]["exp_avg"].dtype == torch.bfloat16  # a checkpoint keeps 2 bytes a moment
    # Into torch's AdamW (fp32 moments, the same values) and back: the steps go on alike.
    torch_opt = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, foreach=False)
    with torch.no_grad():
        for q, p in zip(theirs, ours):
            q.copy_(p)
    torch_opt.load_state_dict(copy.deepcopy(saved))  # as from a file: torch's step counts would share tensors
    assert torch_opt.state[theirs[0]]["exp_avg"].dtype == torch.float32
    again = AdamW(restored, lr=1e-2, weight_decay=0.1)
    again.load_state_dict(torch_opt.state_dict())
    assert again.state[restored[0]]["exp_avg"].dtype == torch.bfloat16
    assert all(group["capturable"] for group in again.param_groups)
    with torch.no_grad():
        for r, p in zip(restored, ours):
            r.copy_(p)
    run(opt, ours, grads[2:])
    run(again, restored, grads[2:])
    for p, r in zip(ours, restored):
        assert torch.equal(p, r)


def test_loaded_moments_are_copies_of_their_own():
    """Loading a live optimizer's state gives moments equal to its own but not shared with it: each steps apart."""
    params, grads = params_and_grads(3)
    ours, theirs = clone(params), clone(params)
    opt = AdamW(ours, lr=1e-2)
    run(opt, ours, grads[:1])
    other = AdamW(theirs, lr=1e-2)
    other.load_state_dict(opt.state_dict())
    for p, q in zip(ours, theirs):
        for key in ("exp_avg", "exp_avg_sq"):
            mine, loaded = opt.state[p][key], other.state[q][key]
            assert torch.equal(mine, loaded) and mine.data_ptr() != loaded.data_ptr()
    run(opt, ours, grads[1:])
    assert not torch.equal(opt.state[ours[0]]["exp_avg"], other.state[theirs[0]]["exp_avg"])


@pytest.mark.skipif(not CUDA, reason="measures CUDA memory")
@pytest.mark.parametrize("saved_dtype", [torch.bfloat16, torch.float32])
def test_loading_allocates_only_the_bf16_moments(saved_dtype):
    """Loading a state allocates the two bf16 moments of each parameter and no fp32 copy of them on the way."""
    n = 1 << 24
    param = torch.nn.Parameter(torch.randn(n, device="cuda"))
    saved = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(n, device="cuda", dtype=saved_dtype),
                           "exp_avg_sq": torch.rand(n, device="cuda", dtype=saved_dtype)}},
             "param_groups": [dict(lr=1e-3, betas=BETAS, eps=EPS, weight_decay=0.0, capturable=True, params=[0])]}
    opt = AdamW([param])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt.load_state_dict(saved)
    torch.cuda.synchronize()
    moments = 2 * n * 2  # two bf16 moments
    assert torch.cuda.memory_allocated() - before <= moments + (1 << 20)
    assert torch.cuda.max_memory_allocated() - before <= moments + (1 << 20)
    assert torch.equal(opt.state[param]["exp_avg"], saved["state"][0]["exp_avg"].to(torch.bfloat16))


@pytest.mark.parametrize("kwargs, message", [(dict(betas=(0.9, 1.0)), r"beta2 is 1.0"),
                                             (dict(betas=(-0.1, 0.9)), r"beta1 is -0.1"),
                                             (dict(eps=-1.0), "must be >= 0")])
def test_refuses_bad_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdamW([torch.nn.Parameter(torch.zeros(3))], **kwargs)


def test_beta1_zero_is_rmsprop_like_without_bias_correction_of_the_first_moment():
    params, grads = params_and_grads(2)
    ours, theirs = clone(params), clone(params)
    run(AdamW(ours, lr=1e-2, betas=(0.0, 0.95), state_dtype=torch.float32), ours, grads)
    run(torch.optim.AdamW(theirs, lr=1e-2, betas=(0.0, 0.95), weight_decay=0.0, foreach=False), theirs, grads)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_refuses_a_parameter_it_cannot_view_flat():
    w = torch.nn.Parameter(torch.randn(8, 6).t())
    with pytest.raises(ValueError, match=r"shape \(6, 8\) is not contiguous"):
        AdamW([w])


def tiny_step(dtype: str, optimizer: str, grad_clip: float = 1.0, device: str = "cpu"):
    cfg = config_for("tiny", d_model=64, n_layers=2, n_heads=2, d_ff=128, vocab_size=256, context_length=32)
    config = resolved(cfg, execution={"dtype": dtype, "device": device},
                      optim={"optimizer": optimizer, "grad_clip": grad_clip})
    torch.manual_seed(0)
    with torch.device(device):
        model = TransformerLM(cfg)
    return build_step(model, config)


def test_it_is_registered_as_an_optimizer_of_shards_that_rewrites_the_weight_copies():
    spec = get_optimizer("adamw-bf16")
    assert spec.build is adamw_bf16.build
    assert spec.steps_in_backward and spec.keeps_weight_copies and spec.shards


def test_the_bf16_state_step_keeps_a_copy_of_every_linear_weight_and_clips_inside_its_update():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(256, (4, 32), generator=g), torch.randint(256, (4, 32), generator=g)
    steps = {state: tiny_step("bf16", optimizer, grad_clip=0.05)
             for state, optimizer in (("fp32", "adamw"), ("bf16", "adamw-bf16"))}
    step = steps["bf16"]
    linears = [m for m in step.model.modules() if isinstance(m, Linear)]
    assert isinstance(step.optimizer, AdamW) and len(step.optimizer.weight_copies) == len(linears) > 0
    assert all(m.weight_copy is not None for m in linears)
    assert all(m.weight_copy is None for m in steps["fp32"].model.modules() if isinstance(m, Linear))
    (loss, norm), (loss_ref, norm_ref) = steps["bf16"](x, y), steps["fp32"](x, y)
    assert torch.equal(loss, loss_ref)
    torch.testing.assert_close(norm, norm_ref)
    assert norm > 0.05  # clipped
    # The first update uses the unrounded moments: the same step as torch's clipped AdamW.
    for p, q in zip(step.model.parameters(), steps["fp32"].model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for m in linears:
        assert torch.equal(m.weight_copy, m.weight.detach().bfloat16())


def test_the_clipping_factor_reaches_the_update(monkeypatch):
    scales = []
    plain_step = AdamW.step
    monkeypatch.setattr(AdamW, "step", lambda self, closure=None, clip_coef=None: (
        scales.append(clip_coef), plain_step(self, closure, clip_coef))[1])
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(256, (4, 32), generator=g), torch.randint(256, (4, 32), generator=g)
    factors = {}
    for clip in (0.0, 0.05, 1e6):
        scales.clear()
        step = tiny_step("bf16", "adamw-bf16", grad_clip=clip)
        _, norm = step(x, y)
        if clip == 0.0:
            # No clipping: no factor, and each parameter's optimizer stepped during the backward.
            assert len(scales) == len(list(step.model.parameters())) and all(s is None for s in scales)
        else:
            (factors[clip],) = scales  # one optimizer, stepped once
            torch.testing.assert_close(factors[clip], torch.clamp(clip / (norm + 1e-6), max=1.0))
    assert factors[0.05] < 1 and factors[1e6] == 1


def test_fp32_compute_keeps_no_weight_copies():
    # fp32 compute reads no copy: none are made, and the optimizer is still the bf16-state one.
    step = tiny_step("fp32", "adamw-bf16")
    assert isinstance(step.optimizer, AdamW) and step.optimizer.weight_copies == {}


KERNEL_DEVICE = "cuda" if CUDA else ("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None)


@pytest.mark.skipif(KERNEL_DEVICE is None, reason="needs CUDA or the Triton interpreter")
@pytest.mark.parametrize("state_dtype, copy_dtype", [(torch.float32, None), (torch.float32, torch.float16)]
                         + [(torch.bfloat16, torch.bfloat16)] * CUDA)  # the interpreter truncates bf16 stores
@pytest.mark.parametrize("numel, beta1", [(1, 0.9), (2047, 0.9), (2048, 0.0), (5000, 0.9)])
@pytest.mark.parametrize("grad_scale", [0.6, None])
def test_the_kernel_is_the_torch_update(numel, beta1, grad_scale, state_dtype, copy_dtype):
    g = torch.Generator().manual_seed(numel)
    make = lambda dtype=torch.float32: torch.randn(numel, generator=g).to(KERNEL_DEVICE, dtype)
    inputs = dict(param=make(), grad=make(), exp_avg=make(state_dtype), exp_avg_sq=make(state_dtype).abs(),
                  copy=None if copy_dtype is None else make(copy_dtype))
    scalars = dict(step=torch.tensor(7.0, device=KERNEL_DEVICE), lr=torch.tensor(3e-3, device=KERNEL_DEVICE),
                   grad_scale=None if grad_scale is None else torch.tensor(grad_scale, device=KERNEL_DEVICE),
                   beta1=beta1, beta2=0.95, eps=1e-8, weight_decay=0.1)
    ours = {k: None if v is None else v.clone() for k, v in inputs.items()}
    adamw_bf16._launch(**ours, **scalars)
    adamw_bf16._update(**inputs, **scalars)
    for name, want in inputs.items():
        if want is not None:  # an element may round the other way where the fp32 values differ in their last bit
            torch.testing.assert_close(ours[name], want, rtol=1e-6 if want.dtype == torch.float32 else 2 ** -7,
                                       atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_the_cuda_update_steps_like_the_cpu_one_and_replays_in_a_cuda_graph():
    params, grads = params_and_grads(3, shapes=((1000, 300), (300,), (7, 9, 11)), device="cuda")
    lr = torch.tensor(1e-2, device="cuda")
    copies = {p: p.detach().bfloat16() for p in params}
    on_cpu = [torch.nn.Parameter(p.detach().cpu()) for p in params]
    # fp32 moments: bf16 ones could round an element the other way on each side, which AdamW then amplifies.
    run(AdamW(params, lr=lr, weight_decay=0.1, weight_copies=copies, state_dtype=torch.float32), params, grads)
    run(AdamW(on_cpu, lr=1e-2, weight_decay=0.1, state_dtype=torch.float32), on_cpu,
        [[g.cpu() for g in step] for step in grads])
    for p, q in zip(params, on_cpu):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-5, atol=1e-6)
        assert torch.equal(copies[p], p.detach().bfloat16())
    # Captured once, replayed: the step count, learning rate and scale are read on the device.
    params, grads = params_and_grads(1, shapes=((1000, 300), (300,)), device="cuda")
    graphed = clone(params)
    opt = AdamW(graphed, lr=lr)
    for p, g in zip(graphed, grads[0]):
        p.grad = g.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step()  # compiles the kernel and makes the state outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    plain = clone(params)
    run(AdamW(plain, lr=lr), plain, [grads[0]] * 3)
    graph.replay()
    graph.replay()
    for p, q in zip(graphed, plain):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert opt.state[graphed[0]]["step"].item() == 3
