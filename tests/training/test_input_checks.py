import argparse

import numpy as np
import pytest
import torch

from training.input_checks import (InputError, backend_problem, check_bin_size, check_text, check_token_ids,
                                   flag_problem, flag_warnings, text_problem)


def flags(**kw) -> argparse.Namespace:
    base = dict(eval_every=200, ckpt_every=500, grad_clip=1.0, warmup_steps=100, lr=6e-4, min_lr=6e-5,
                weight_decay=0.1, keep_checkpoints=2, resume=False, overwrite=False, steps=2000)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("kw, message", [
    (dict(eval_every=-1), "--eval-every must be >= 0 (0: evaluate only at the end), got -1"),
    (dict(ckpt_every=-3), "--ckpt-every must be >= 0 (0: checkpoint only at the end), got -3"),
    (dict(grad_clip=-1.0), "--grad-clip must be >= 0 (0 disables clipping), got -1"),
    (dict(warmup_steps=-5), "--warmup-steps must be >= 0 (0: no warm-up), got -5"),
    (dict(lr=-0.1), "--lr must be >= 0, got -0.1"),
    (dict(keep_checkpoints=0), "--keep-checkpoints must be >= 1 (checkpoints kept on disk), got 0"),
    (dict(resume=True, overwrite=True), "--resume continues the run in --out and --overwrite moves it aside: "
                                        "pass one of them"),
])
def test_negative_and_contradictory_flags(kw, message):
    assert flag_problem(flags(**kw)) == message


def test_good_flags_and_a_warm_up_longer_than_the_run():
    assert flag_problem(flags()) is None and flag_problem(flags(eval_every=0, ckpt_every=0, grad_clip=0)) is None
    assert flag_warnings(flags(), {"warmup_steps"}) == []
    assert flag_warnings(flags(warmup_steps=3000), set()) == []  # the default: not the user's choice
    assert flag_warnings(flags(warmup_steps=3000), {"warmup_steps"}) == [
        "warning: --warmup-steps 3000 is not shorter than the run (--steps 2000): the learning rate never reaches "
        "--lr 0.0006"]


def test_a_window_that_changes_no_layer_is_said():
    window = dict(window=64, window_pattern="LLLG", context_length=128)
    assert flag_warnings(flags(**window), set()) == []
    assert flag_warnings(flags(**{**window, "window_pattern": "G"}), set()) == [
        "warning: --window-pattern G has no local layer (L): --window 64 changes no layer"]
    assert flag_warnings(flags(**{**window, "window": 128}), set()) == [
        "warning: --window 128 is not shorter than --context-length 128: the local layers see their whole context, "
        "as without a window"]


# Why SDPA pinned to its flash kernel cannot take CPU tensors: without a GPU, the machine lacks one; with one, the
# tensors are on the wrong device.
SDPA_FLASH_ON_CPU = {False: "needs a CUDA GPU", True: "needs CUDA tensors, got cpu"}


@pytest.mark.parametrize("gpu", sorted({torch.cuda.is_available(), True}), ids=lambda gpu: f"gpu={gpu}")
def test_backends_are_checked_against_the_device_without_a_model(monkeypatch, gpu):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)  # True: as on a GPU machine (a no-op on one)
    assert backend_problem("sdpa", "cpu", torch.float32, d_head=16) is None
    message = backend_problem("sdpa-flash", "cpu", torch.float32, d_head=16)
    assert message.startswith(f"--attn sdpa-flash cannot run on cpu with float32 for training: "
                              f"{SDPA_FLASH_ON_CPU[gpu]}; backends that can: naive, compiled, sdpa")
    assert "sdpa-flash" not in message.split("backends that can:")[1]
    if not torch.cuda.is_available():
        flex = backend_problem("flex", "cpu", torch.float32, d_head=16)
        assert "FlexAttention has no backward on the CPU" in flex
        assert backend_problem("flex", "cpu", torch.float32, d_head=16, training=False) is None


def test_the_models_attention_variants_are_checked_too():
    message = backend_problem("sdpa", "cpu", torch.float32, d_head=16, kv_groups=2, window=8, softcap=50.0)
    assert message.startswith("--attn sdpa cannot run on cpu with float32 for training: it does not support logit "
                              "soft-capping")
    assert "backends that can: naive, compiled" in message and ", sdpa" not in message.split("can:")[1]
    assert backend_problem("sdpa", "cpu", torch.float32, d_head=16, kv_groups=2, window=8, documents=True) is None
    pinned = backend_problem("sdpa-flash", "cpu", torch.float32, d_head=16, documents=True)
    assert pinned is not None and "backends that can: naive, compiled, sdpa" in pinned


@pytest.mark.parametrize("data, problem", [
    ("héllo wörld\n".encode(), None),
    (b"", "is empty"),
    ("hello".encode("utf-16"), "is UTF-16 text, not UTF-8 (it starts with a UTF-16 byte-order mark)"),
    ("hello".encode("utf-32"), "is UTF-32 text, not UTF-8"),
    ("some plain text".encode("utf-16-le"), "looks like UTF-16 text, not UTF-8 (every other byte is 0)"),
    (bytes(range(256)) * 4, "is binary, not text (it holds NUL bytes)"),
    ("naïve".encode("latin-1"), "is not UTF-8 text (byte 0xef at offset 2)"),
])
def test_text_that_is_not_utf8_says_what_it_is(data, problem):
    found = text_problem(data)
    assert found == problem if problem is None else found.startswith(problem)


def test_text_file_error_names_the_file(tmp_path):
    with pytest.raises(InputError, match=rf"^--data {tmp_path}/a.txt is UTF-16 text, not UTF-8"):
        check_text(tmp_path / "a.txt", "x".encode("utf-16"))


def test_bin_files_hold_whole_uint16_values(tmp_path):
    odd, empty, good = tmp_path / "odd.bin", tmp_path / "empty.bin", tmp_path / "good.bin"
    odd.write_bytes(b"\1" * 1001)
    empty.write_bytes(b"")
    good.write_bytes(b"\1" * 1000)
    with pytest.raises(InputError, match=rf"^--data {odd} has an odd number of bytes \(1,001\): a .bin token file "
                                         r"holds uint16 ids of 2 bytes each"):
        check_bin_size(odd)
    with pytest.raises(InputError, match=rf"^--data {empty} is empty$"):
        check_bin_size(empty)
    check_bin_size(good)


def test_token_ids_must_index_the_vocabulary(tmp_path):
    check_token_ids(np.array([0, 5, 9], dtype=np.int64), 10, "t.npy")
    with pytest.raises(InputError, match=r"^t.npy holds token id -1 \(the first negative one at position 2\); "
                                         r"ids must be in \[0, 10\)$"):
        check_token_ids(np.array([3, 4, -1, 5, -1]), 10, "t.npy")
    with pytest.raises(InputError, match=r"^t.bin holds token id 10, but the model's vocabulary is 10; pass "
                                         r"--vocab-size 11 or more$"):
        check_token_ids(np.array([3, 10], dtype=np.uint16), 10, "t.bin")
    with pytest.raises(InputError, match="^t.npy holds no tokens$"):
        check_token_ids(np.array([], dtype=np.int32), 10, "t.npy")
    path = tmp_path / "m.npy"  # a memmap, as the data is opened
    np.save(path, np.array([1, -7, 2], dtype=np.int32))
    with pytest.raises(InputError, match="holds token id -7"):
        check_token_ids(np.load(path, mmap_mode="r"), 10, str(path))
