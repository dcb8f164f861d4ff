"""The defaults of --dtype, --compile and --cuda-graph: the fast path wherever it applies, and a line saying so."""

import pytest
import torch

import train
from training.speed_defaults import choose

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
UNSET = dict(dtype=None, compile=None, cuda_graph=None)


def test_cuda_defaults_to_bf16_compiled_and_graphed():
    c = choose(CUDA, **UNSET)
    assert (c.dtype, c.compile, c.cuda_graph) == ("bf16", torch._dynamo.is_dynamo_supported(), True)
    assert c.line.startswith("speed: bf16; ") and "--no-cuda-graph to opt out" in c.line


def test_cpu_defaults_to_fp32_eager():
    c = choose(CPU, **UNSET)
    assert (c.dtype, c.compile, c.cuda_graph) == ("fp32", False, False)
    assert c.line == "speed: fp32; eager: on the CPU (--compile compiles); no CUDA graph: needs CUDA"


@pytest.mark.parametrize("setting, reason", [
    (dict(parallel="ddp"), "no CUDA graph: --parallel ddp"),
    (dict(parallel="fsdp"), "no CUDA graph: --parallel fsdp"),
    (dict(dtype="fp16"), "no CUDA graph: --dtype fp16, whose gradient scaler checks for inf on the host"),
    (dict(activation_checkpointing=True), "no CUDA graph: --activation-checkpointing"),
])
def test_the_graph_stays_off_where_it_does_not_apply_and_says_why(setting, reason):
    c = choose(CUDA, **{**UNSET, **setting})
    assert not c.cuda_graph and reason in c.line
    assert c.compile == torch._dynamo.is_dynamo_supported()  # compiling still applies


def test_given_flags_win():
    c = choose(CUDA, dtype="fp32", compile=False, cuda_graph=False)
    assert (c.dtype, c.compile, c.cuda_graph) == ("fp32", False, False)
    assert c.line == "speed: fp32; eager; no CUDA graph"
    forced = choose(CPU, dtype="bf16", compile=True, cuda_graph=None)
    assert (forced.dtype, forced.compile, forced.cuda_graph) == ("bf16", True, False)


def test_train_py_fills_in_the_defaults_and_keeps_the_opt_outs():
    parser = train.build_parser()

    def resolved(*argv):
        args = parser.parse_args(["--device", "cpu", *argv])
        line = train.check_args(parser, args)
        return args, line

    args, line = resolved()
    assert (args.dtype, args.compile, args.cuda_graph) == ("fp32", False, False) and line.startswith("speed: fp32")
    args, _ = resolved("--compile", "--dtype", "bf16")
    assert (args.dtype, args.compile, args.cuda_graph) == ("bf16", True, False)
    args, _ = resolved("--no-compile", "--no-cuda-graph")
    assert (args.compile, args.cuda_graph) == (False, False)


def test_a_cuda_graph_asked_for_on_the_cpu_is_still_an_error(capsys):
    parser = train.build_parser()
    with pytest.raises(SystemExit):
        train.check_args(parser, parser.parse_args(["--device", "cpu", "--cuda-graph"]))
    assert "--cuda-graph needs a CUDA device" in capsys.readouterr().err
