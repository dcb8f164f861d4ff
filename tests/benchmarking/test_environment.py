import datetime
import subprocess

import torch

from benchmarking.environment import describe, environment_info, git_commit


def test_environment_info_fields():
    info = environment_info("cpu")
    for key in ("device", "gpu_name", "cuda", "cudnn", "torch", "triton", "python", "hostname", "date", "git_commit"):
        assert key in info
    assert info["torch"] == torch.__version__
    assert info["device"] == "cpu" and info["gpu_name"] is None
    assert datetime.datetime.fromisoformat(info["date"]).tzinfo is not None
    assert "torch " + torch.__version__ in describe(info)


def test_git_commit(tmp_path):
    assert git_commit(tmp_path) is None  # not a repository
    run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (tmp_path / "f.txt").write_text("one")
    run("add", "f.txt")
    run("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "init")
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert git_commit(tmp_path) == sha
    (tmp_path / "f.txt").write_text("two")
    assert git_commit(tmp_path) == sha + "-dirty"
    assert describe({"git_commit": sha + "-dirty"}).endswith(f"git {sha[:12]}-dirty")  # not cut off
