"""training/cuda_graph.py: a replayed step trains exactly as the plain step (GPU), and refusals (any machine)."""

from __future__ import annotations

import pytest
import torch

from model import ModelConfig, TransformerLM
from tests.training.resolved import resolved
from training.cuda_graph import GraphedStep
from training.step import build_step

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
CFG = ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128, vocab_size=256, context_length=32)


def _setup(device: str, capturable: bool):
    torch.manual_seed(0)
    model = TransformerLM(CFG, "sdpa").to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device=device), fused=device == "cuda",
                            capturable=capturable)

    def step(ids, targets):
        loss = model(ids, targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        return loss.detach(), norm

    return model, opt, step


def _batches(n: int, device: str):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(256, (4, 32), generator=g).to(device), torch.randint(256, (4, 32), generator=g).to(device))
            for _ in range(n)]


@requires_cuda
def test_replayed_steps_train_like_the_plain_steps():
    batches = _batches(7, "cuda")
    model, opt, step = _setup("cuda", capturable=False)
    plain = []
    for i, (x, y) in enumerate(batches):
        opt.param_groups[0]["lr"].fill_(1e-3 / (i + 1))  # a schedule: the tensor lr is updated in place
        opt.zero_grad(set_to_none=True)
        plain.append([t.item() for t in step(x, y)])
    plain_params = [p.detach().clone() for p in model.parameters()]

    model, opt, step = _setup("cuda", capturable=True)
    graphed = GraphedStep(step, opt, warmup=2)
    replayed = []
    for i, (x, y) in enumerate(batches):
        opt.param_groups[0]["lr"].fill_(1e-3 / (i + 1))
        replayed.append([t.item() for t in graphed(x, y)])
    assert graphed.captured and graphed.calls == 7
    # Steps 1-2 eager, 3 captured then replayed, 4-7 replays: each saw its own batch and learning rate.
    torch.testing.assert_close(torch.tensor(replayed), torch.tensor(plain), rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), plain_params):
        torch.testing.assert_close(p.detach(), q, rtol=1e-4, atol=1e-5)


@requires_cuda
def test_compiled_model_with_strided_batches_is_captured_without_recompiling():
    """Batches sliced from (batch, seq + 1) windows, as train.py's: the static inputs keep their strides, so the
    compiled regions' stride guards hold at capture (a recompile inside a capture fails)."""
    from training.compilation import compile_regions

    torch._dynamo.reset()
    model, opt, step = _setup("cuda", capturable=True)
    compile_regions(model)
    graphed = GraphedStep(step, opt, warmup=2)
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        window = torch.randint(256, (4, 33), generator=g).cuda()
        loss, _ = graphed(window[:, :-1], window[:, 1:])  # strides (33, 1), not contiguous
        assert torch.isfinite(loss)
    assert graphed.captured and graphed.static_inputs[0].stride() == (33, 1)
    torch._dynamo.reset()


@requires_cuda
def test_a_new_shape_after_capture_is_refused_with_both_shapes():
    _, opt, step = _setup("cuda", capturable=True)
    graphed = GraphedStep(step, opt, warmup=1)
    (x, y), = _batches(1, "cuda")
    graphed(x, y)
    graphed(x, y)
    with pytest.raises(ValueError, match=r"input 0 is \(4, 16\).*captured with \(4, 32\)"):
        graphed(x[:, :16], y[:, :16])


def test_optimizer_without_capturable_is_refused():
    _, opt, step = _setup("cpu", capturable=False)
    with pytest.raises(ValueError, match="capturable=True"):
        GraphedStep(step, opt)


def test_cpu_tensors_are_refused():
    model = TransformerLM(CFG, "sdpa")
    opt = torch.optim.AdamW(model.parameters(), capturable=True)
    graphed = GraphedStep(lambda x, y: (model(x, y),), opt)
    (x, y), = _batches(1, "cpu")
    with pytest.raises(ValueError, match="needs CUDA tensors, got one on cpu"):
        graphed(x, y)


@requires_cuda
def test_warm_up_and_capture_run_inside_graph_replay():
    from attention.registry import graph_replay_requested

    _, opt, step = _setup("cuda", capturable=True)
    seen = []

    def recording_step(x, y):
        seen.append(graph_replay_requested())
        return step(x, y)

    graphed = GraphedStep(recording_step, opt, warmup=2)
    for x, y in _batches(4, "cuda"):
        graphed(x, y)
    assert seen == [True, True, True]  # two eager steps and the capture; replays run no Python
    assert not graph_replay_requested()


def _doc_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Batches of packed documents: each row cut into documents at random places, other cuts every batch."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        x, y = (torch.randint(256, (4, 32), generator=g) for _ in range(2))
        cuts = torch.rand(4, 32, generator=g) < 0.15
        cuts[:, 0] = False
        out.append((x.cuda(), y.cuda(), cuts.long().cumsum(-1).cuda()))
    return out


@requires_cuda
@pytest.mark.parametrize("attn", ["flash", "sdpa", "flex"])
def test_packed_documents_replay_like_the_plain_steps(attn):
    """The document masks come from each batch's doc_ids, copied into the graph's static input: replayed steps train
    as the plain steps do, batch after batch of other documents."""
    losses = []
    for capturable in (False, True):
        torch.manual_seed(0)
        model = TransformerLM(CFG, attn).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), capturable=capturable)

        def step(ids, targets, doc_ids):
            loss = model(ids, targets, doc_ids=doc_ids)
            loss.backward()
            opt.step()
            return (loss.detach(),)

        run = GraphedStep(step, opt, warmup=2) if capturable else step
        row = []
        for x, y, doc_ids in _doc_batches(6):
            opt.zero_grad(set_to_none=True)
            row.append(run(x, y, doc_ids)[0].item())
        losses.append(row)
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=2e-3, atol=2e-3)


def built_step(model_cfg: ModelConfig, graph: bool, execution: dict, optim: dict):
    """(model, build_step's step) on the GPU from seed 0, captured in a CUDA graph or not."""
    config = resolved(model_cfg, execution={"device": "cuda", "cuda_graph": graph, **execution}, optim=optim)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = TransformerLM(config.model, config.execution.attn)
    step = build_step(model, config)
    assert (step.graphed is not None) == graph
    return model, step


@requires_cuda
@pytest.mark.parametrize("embed_lr_scale", [1.0, 10.0])
@pytest.mark.parametrize("grad_clip", [0.0, 0.5], ids=["stepped-in-backward", "clipped"])
def test_the_built_step_replays_like_the_eager_step_with_its_learning_rate_set_each_step(grad_clip, embed_lr_scale):
    """build_step with --cuda-graph: the optimizer's learning rates are device tensors that set_lr fills in place (the
    embedding's at its own scale), so the replays follow the schedule; losses, norms and weights as the eager step's."""
    results = []
    for graph in (False, True):
        model, step = built_step(CFG, graph, execution={"dtype": "fp32", "compile": False},
                                 optim={"grad_clip": grad_clip, "embed_lr_scale": embed_lr_scale})
        row = []
        for i, (x, y) in enumerate(_batches(6, "cuda")):
            step.set_lr(1e-3 / (i + 1))
            loss, norm = step(x, y)
            row.append([loss.item(), norm.item()])
        assert not graph or step.graphed.captured
        results.append((row, [p.detach().clone() for p in model.parameters()]))
    (eager, eager_params), (replayed, replayed_params) = results
    torch.testing.assert_close(torch.tensor(replayed), torch.tensor(eager), rtol=1e-4, atol=1e-5)
    for p, q in zip(replayed_params, eager_params):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


@requires_cuda
def test_the_speedrun_recipe_compiled_and_graphed_with_flash_trains_like_its_eager_step():
    """The recipe's model options and Muon under compile and a CUDA graph, with flash: the losses of the eager step,
    in bf16."""
    from training.recipes import recipe_sections

    sections = recipe_sections("speedrun")
    model_cfg = ModelConfig(**{**CFG.to_dict(), **sections["model"], "window": 8})
    losses = []
    for fast in (False, True):
        model, step = built_step(model_cfg, fast, execution={"dtype": "bf16", "attn": "flash", "compile": fast},
                                 optim=sections["optim"])
        initial = {name: p.detach().clone() for name, p in model.named_parameters()}
        row = []
        for x, y in _batches(6, "cuda"):
            step.set_lr(1e-3)
            row.append(step(x, y)[0].item())
        losses.append(row)
        # Every parameter is updated (random tokens leave the loss little to fall by: ln 256 is the floor).
        assert [n for n, p in model.named_parameters() if torch.equal(p, initial[n])] == []
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=2e-2, atol=2e-2)
