"""Tests for train.py: DDP equivalence (torchrun, gloo), gradient accumulation, exact resume, schedule, errors."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import prepare_data
import train

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    words = "the king queen crown sword night day love death time heart blood my thy lord".split()
    rng = random.Random(0)
    (root / "corpus").mkdir()
    for i in range(6):
        (root / "corpus" / f"{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(3000)))
    prepare_data.main(["--dataset", "files", "--path", str(root / "corpus"), "--out_dir", str(root / "chars")])
    return root / "chars"


def tiny_args(data_dir, out_dir, **overrides):
    args = dict(data_dir=data_dir, out_dir=out_dir, block_size=16, n_layer=2, n_head=2, n_embd=32, batch_size=4,
                max_iters=6, eval_interval=3, eval_iters=2, log_interval=1, device="cpu", warmup_iters=2,
                lr_decay_iters=6, learning_rate=1e-2, min_lr=1e-3)
    args.update(overrides)
    return [f"--{k}={v}" for k, v in args.items()]


def read_log(out_dir):
    lines = [json.loads(line) for line in (Path(out_dir) / "log.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r], [r for r in lines if "val_loss" in r]


def losses(out_dir):
    return [r["loss"] for r in read_log(out_dir)[0]]


def test_log_and_checkpoint_contents(data_dir, tmp_path):
    train.main(tiny_args(data_dir, tmp_path / "run"))
    steps, evals = read_log(tmp_path / "run")
    assert [r["iter"] for r in steps] == list(range(6)) and [r["iter"] for r in evals] == [0, 3, 6]
    for r in steps:
        assert {"iter", "loss", "lr", "ms_per_iter", "tokens_per_s"} <= r.keys() and r["lr"] > 0
    assert steps[-1]["loss"] < steps[0]["loss"]
    ckpt = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 6 and ckpt["best_val_loss"] == min(r["val_loss"] for r in evals)
    assert ckpt["model_args"]["pos"] == "xpos" and ckpt["config"]["block_size"] == 16 and len(ckpt["rng"]) == 1
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in ckpt["model"])
    assert {"optimizer", "scaler", "data"} <= ckpt.keys()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["ckpt.pt", "log.jsonl"]  # no .tmp left


def test_resume_is_exact(data_dir, tmp_path):
    common = dict(dropout=0.1, eval_interval=100)  # dropout: the RNG state must come back too
    train.main(tiny_args(data_dir, tmp_path / "straight", **common))
    train.main(tiny_args(data_dir, tmp_path / "halves", max_iters=3, **common))
    train.main(tiny_args(data_dir, tmp_path / "halves", init_from="resume", **common))
    assert len(losses(tmp_path / "straight")) == 6
    assert losses(tmp_path / "halves") == losses(tmp_path / "straight")  # bitwise, float32 on CPU
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "halves" / "ckpt.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_gradient_accumulation_equals_larger_batch(data_dir, tmp_path):
    train.main(tiny_args(data_dir, tmp_path / "big", batch_size=8))
    train.main(tiny_args(data_dir, tmp_path / "accum", batch_size=4, gradient_accumulation_steps=2))
    big, accum = losses(tmp_path / "big"), losses(tmp_path / "accum")
    assert len(big) == 6 and max(abs(x - y) for x, y in zip(big, accum)) < 1e-5
    assert big[0] != big[-1]


def test_ddp_two_processes_match_one(data_dir, tmp_path):
    args = tiny_args(data_dir, tmp_path / "ddp", gradient_accumulation_steps=2)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *args]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    train.main(tiny_args(data_dir, tmp_path / "single", gradient_accumulation_steps=2))
    ddp, single = read_log(tmp_path / "ddp"), read_log(tmp_path / "single")
    assert len(ddp[0]) == 6 and max(abs(a["loss"] - b["loss"]) for a, b in zip(ddp[0], single[0])) < 1e-5
    assert max(abs(a["val_loss"] - b["val_loss"]) for a, b in zip(ddp[1], single[1])) < 1e-5
    assert len(torch.load(tmp_path / "ddp" / "ckpt.pt", weights_only=True)["rng"]) == 2  # every rank's RNG


def test_float16_grad_scaler_on_cpu(data_dir, tmp_path):
    train.main(tiny_args(data_dir, tmp_path / "fp16", dtype="float16"))
    steps = read_log(tmp_path / "fp16")[0]
    assert all("grad_scale" in r and "skipped_steps" in r for r in steps)
    assert steps[0]["grad_scale"] > 1 and steps[-1]["loss"] < steps[0]["loss"]


def test_non_finite_loss_stops_and_keeps_checkpoint(data_dir, tmp_path, monkeypatch):
    out = tmp_path / "nan"
    train.main(tiny_args(data_dir, out, max_iters=3))
    good = (out / "ckpt.pt").read_bytes()
    forward = train.GPT.forward

    def poisoned(self, idx, targets=None, **kw):
        logits, loss = forward(self, idx, targets, **kw)
        return logits, (loss * float("nan") if self.training else loss)

    monkeypatch.setattr(train.GPT, "forward", poisoned)
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(data_dir, out, init_from="resume"))
    assert "non-finite loss nan at iter 3" in str(e.value.code)
    assert (out / "ckpt.pt").read_bytes() == good


def test_lr_schedule():
    c = dict(train.DEFAULTS, learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
    lrs = [train.get_lr(i, c) for i in range(120)]
    assert 0 < lrs[0] < lrs[5] < lrs[9] < 1.0  # non-zero at step 0, warming up
    assert lrs[10] == pytest.approx(1.0) and lrs[60] == pytest.approx(0.55)  # cosine: halfway at the middle
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[110] == lrs[119] == 0.1
    poly = dict(c, lr_schedule="polynomial", lr_power=1.0)
    assert train.get_lr(60, poly) == pytest.approx(0.55) and train.get_lr(35, poly) == pytest.approx(0.775)
    assert train.get_lr(50, dict(c, decay_lr=False)) == 1.0


@pytest.mark.parametrize("argv,message", [
    (["--nope=1"], "unknown config key 'nope'"),
    (["--n_layer=two"], "n_layer='two' (from --n_layer=two) must be a int"),
    (["--dtype=fp8"], "must be one of auto, float32, bfloat16, float16"),
    (["--pos=rotary"], "GPTConfig.pos='rotary' is not allowed"),
    (["--block_size"], "expected --key=value"),
    (["missing_config.py"], "config file 'missing_config.py' does not exist"),
])
def test_config_errors(data_dir, tmp_path, argv, message):
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(data_dir, tmp_path / "x") + argv)
    assert message in str(e.value.code)


def test_config_file_keys_are_checked(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("learning_rate = 3e-4\nlearnig_rate = 1e-3\n")
    with pytest.raises(SystemExit) as e:
        train.main([str(bad)])
    assert f"unknown config key 'learnig_rate' (from {bad})" in str(e.value.code)
    config = train.load_config(["config/shakespeare_char_rope.py", "--max_iters=7"])
    assert config["pos"] == "rope" and config["n_embd"] == 128 and config["max_iters"] == 7
    paper = train.load_config(["config/paper_lex_350m.py"])
    assert paper["batch_size"] * paper["gradient_accumulation_steps"] * paper["block_size"] == 524288


def test_missing_and_corrupt_checkpoint(data_dir, tmp_path):
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(data_dir, tmp_path / "none", init_from="resume"))
    assert "no checkpoint at" in str(e.value.code)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "ckpt.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(data_dir, tmp_path / "bad", init_from="resume"))
    assert "is unreadable (truncated or corrupt?)" in str(e.value.code)
    assert (tmp_path / "bad" / "ckpt.pt").read_bytes() == b"not a checkpoint at all"
