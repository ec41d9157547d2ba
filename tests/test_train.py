"""Tests for train.py: DDP equivalence (torchrun, gloo), gradient accumulation, exact resume,
schedule, errors."""

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import prepare_data
import train
from lexgpt import train_setup
from model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parent.parent


def words_dataset(root):
    """A character dataset in root/chars: 6 documents of 3,000 seeded random words (5
    train, 1 validation)."""
    words = "the king queen crown sword night day love death time heart blood my thy lord".split()
    rng = random.Random(0)
    (root / "corpus").mkdir()
    for i in range(6):
        (root / "corpus" / f"{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(3000)))
    prepare_data.main(["--dataset", "files", "--path", str(root / "corpus"),
                       "--out_dir", str(root / "chars")])
    return root / "chars"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return words_dataset(tmp_path_factory.mktemp("data"))


def tiny_args(data_dir, out_dir, **overrides):
    args = dict(data_dir=data_dir, out_dir=out_dir, block_size=16, n_layer=2, n_head=2, n_embd=32,
                batch_size=4, max_iters=6, eval_interval=3, eval_iters=2, log_interval=1,
                device="cpu", warmup_iters=2, lr_decay_iters=6, learning_rate=1e-2, min_lr=1e-3)
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
    assert (ckpt["model_args"]["pos"] == "xpos" and ckpt["config"]["block_size"] == 16
            and len(ckpt["rng"]) == 1)
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in ckpt["model"])
    assert {"optimizer", "scaler", "data"} <= ckpt.keys()
    # no .tmp left
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["ckpt.pt", "log.jsonl"]


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


@pytest.mark.slow
def test_ddp_two_processes_match_one(data_dir, tmp_path):
    args = tiny_args(data_dir, tmp_path / "ddp", gradient_accumulation_steps=2)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", "train.py", *args]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    train.main(tiny_args(data_dir, tmp_path / "single", gradient_accumulation_steps=2))
    ddp, single = read_log(tmp_path / "ddp"), read_log(tmp_path / "single")
    assert (len(ddp[0]) == 6
            and max(abs(a["loss"] - b["loss"]) for a, b in zip(ddp[0], single[0])) < 1e-5)
    assert max(abs(a["val_loss"] - b["val_loss"]) for a, b in zip(ddp[1], single[1])) < 1e-5
    # every rank's RNG
    assert len(torch.load(tmp_path / "ddp" / "ckpt.pt", weights_only=True)["rng"]) == 2


@pytest.mark.slow
def test_two_nodes_on_one_machine_match_one_process(data_dir, tmp_path):
    """torchrun --nnodes=2, one process per "node", both on 127.0.0.1 (the multi-node rendezvous,
    over gloo): the same losses as one process, and a resume on both nodes continues the run."""
    from test_common import free_port
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def nodes(args):
        port = free_port()  # the rendezvous's, new for each run
        procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                                   f"--node_rank={rank}", "--nproc_per_node=1",
                                   "--master_addr=127.0.0.1", f"--master_port={port}", "train.py",
                                   *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
        for proc in procs:
            stderr = proc.communicate(timeout=300)[1]
            assert proc.returncode == 0, stderr[-2000:]

    nodes(tiny_args(data_dir, tmp_path / "nodes", gradient_accumulation_steps=2, max_iters=4))
    nodes(tiny_args(data_dir, tmp_path / "nodes", gradient_accumulation_steps=2,
                    init_from="resume"))
    train.main(tiny_args(data_dir, tmp_path / "single", gradient_accumulation_steps=2))
    nodes_log, single = read_log(tmp_path / "nodes"), read_log(tmp_path / "single")
    assert [r["iter"] for r in nodes_log[0]] == list(range(6))
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(nodes_log[0], single[0])) < 1e-5
    assert max(abs(a["val_loss"] - b["val_loss"]) for a, b in zip(nodes_log[1], single[1])) < 1e-5


def test_float16_grad_scaler_on_cpu(data_dir, tmp_path):
    train.main(tiny_args(data_dir, tmp_path / "fp16", dtype="float16"))
    steps = read_log(tmp_path / "fp16")[0]
    assert all("grad_scale" in r and "skipped_steps" in r for r in steps)
    assert steps[0]["grad_scale"] > 1 and steps[-1]["loss"] < steps[0]["loss"]


def test_non_finite_loss_stops_and_keeps_checkpoint(data_dir, tmp_path, monkeypatch):
    out = tmp_path / "nan"
    train.main(tiny_args(data_dir, out, max_iters=3))
    good = (out / "ckpt.pt").read_bytes()
    forward = GPT.forward

    def poisoned(self, idx, targets=None, **kw):
        logits, loss = forward(self, idx, targets, **kw)
        return logits, (loss * float("nan") if self.training else loss)

    monkeypatch.setattr(GPT, "forward", poisoned)
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(data_dir, out, init_from="resume"))
    assert "non-finite loss at iter 3" in str(e.value.code)
    assert (out / "ckpt.pt").read_bytes() == good


def test_lr_schedule():
    c = train.TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
    lrs = [train.get_lr(i, c) for i in range(120)]
    assert 0 < lrs[0] < lrs[5] < lrs[9] < 1.0  # non-zero at step 0, warming up
    # cosine: halfway at the middle
    assert lrs[10] == pytest.approx(1.0) and lrs[60] == pytest.approx(0.55)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[110] == lrs[119] == 0.1
    poly = replace(c, lr_schedule="polynomial", lr_power=1.0)
    assert (train.get_lr(60, poly) == pytest.approx(0.55)
            and train.get_lr(35, poly) == pytest.approx(0.775))
    assert train.get_lr(50, replace(c, decay_lr=False)) == 1.0


@pytest.mark.parametrize("argv,message", [
    (["--nope=1"], "unknown config key 'nope'"),
    (["--n_layer=two"], "n_layer='two' (from --n_layer=two) must be a int"),
    (["--dtype=fp8"], "must be one of auto, float32, bfloat16, float16"),
    (["--pos=rotary"], "GPTConfig.pos='rotary' is not allowed"),
    (["--block_size"], "expected --key=value"),
    (["missing_config.py"], "config file 'missing_config.py' does not exist"),
    ([str(ROOT / "config")], f"config file '{ROOT / 'config'}' is a directory, not a file"),
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
    assert config.pos == "rope" and config.n_embd == 128 and config.max_iters == 7
    paper = train.load_config(["config/paper_lex_350m.py"])
    assert paper.batch_size * paper.gradient_accumulation_steps * paper.block_size == 524288


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


# --- nothing lost, nothing mixed ------------------------------------------------------------------


def log_entries(out_dir):
    """log.jsonl without its timings, which differ between any two runs."""
    lines = (Path(out_dir) / "log.jsonl").read_text().splitlines()
    timings = ("ms_per_iter", "tokens_per_s", "mfu", "data_wait")
    return [{k: v for k, v in json.loads(line).items() if k not in timings} for line in lines]


def logged_iters(out_dir):
    """Training-step iterations in a log that another process may be writing (its last line
    may be cut short)."""
    iters = []
    for line in (Path(out_dir) / "log.jsonl").read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        iters += [entry["iter"]] if "loss" in entry else []
    return iters


class Killed(BaseException):
    """Stands for SIGKILL: nothing in train.py catches it."""


def kill_at_call(monkeypatch, n):
    calls, real = [], train.get_batch

    def get_batch(*args):
        calls.append(1)
        if len(calls) == n:
            raise Killed
        return real(*args)

    monkeypatch.setattr(train, "get_batch", get_batch)


def test_log_after_kills_and_resumes_equals_the_uninterrupted_run(data_dir, tmp_path, monkeypatch):
    common = dict(eval_interval=2)
    train.main(tiny_args(data_dir, tmp_path / "straight", **common))
    out = tmp_path / "killed"
    # mid-evaluation at iter 4, then at iter 6
    for kill, init_from in ((15, "scratch"), (13, "resume")):
        kill_at_call(monkeypatch, kill)
        with pytest.raises(Killed):
            train.main(tiny_args(data_dir, out, init_from=init_from, **common))
        # as a kill during torch.save leaves it
        (out / "ckpt.pt.tmp").write_bytes(b"half a checkpoint")
        assert (len(log_entries(out))
                > torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] + 1)
    monkeypatch.undo()
    train.main(tiny_args(data_dir, out, init_from="resume", **common))
    assert log_entries(out) == log_entries(tmp_path / "straight")
    assert sorted(p.name for p in out.iterdir()) == ["ckpt.pt", "log.jsonl"]  # no debris


def assert_resume_equals_straight(cmd, out, data_dir, tmp_path, args):
    """Resume the interrupted run in out to its end: its log equals an uninterrupted
    run's, timings aside."""
    subprocess.run([*cmd, "--init_from=resume"], cwd=ROOT, check=True, capture_output=True)
    train.main(tiny_args(data_dir, tmp_path / "straight", **args))
    resumed, straight = log_entries(out), log_entries(tmp_path / "straight")
    assert [e["iter"] for e in resumed] == [e["iter"] for e in straight]
    for a, b in zip(resumed, straight):
        assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-5) for k in a)


@pytest.mark.slow
def test_sigkill_and_resume(data_dir, tmp_path):
    """A real kill -9 at an arbitrary moment after the first checkpoint, then a resume to the end (a
    run long enough that the kill comes seconds before its end, even on a busy machine)."""
    args = dict(max_iters=200, eval_interval=4, eval_iters=10)
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", *tiny_args(data_dir, out, **args)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while proc.poll() is None and not ((out / "log.jsonl").exists()
                                           and any(i >= 10 for i in logged_iters(out))):
            time.sleep(0.01)
        assert proc.poll() is None, "training ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert_resume_equals_straight(cmd, out, data_dir, tmp_path, args)


def test_scratch_never_replaces_a_run_silently(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    train.main(tiny_args(data_dir, out, max_iters=3))
    checkpoint, log = (out / "ckpt.pt").read_bytes(), (out / "log.jsonl").read_text()
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(data_dir, out))
    assert "--init_from=resume" in str(e.value.code) and "--overwrite=True" in str(e.value.code)
    assert (out / "ckpt.pt").read_bytes() == checkpoint and (out / "log.jsonl").read_text() == log
    train.main(tiny_args(data_dir, out, overwrite=True))
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 6
    assert [e["iter"] for e in log_entries(out) if "val_loss" in e] == [0, 3, 6]


def test_nothing_to_train_writes_nothing(data_dir, tmp_path, capsys):
    train.main(tiny_args(data_dir, tmp_path / "zero", max_iters=0))
    assert ("no checkpoint written" in capsys.readouterr().out
            and not (tmp_path / "zero" / "ckpt.pt").exists())
    train.main(tiny_args(data_dir, tmp_path / "run", max_iters=3))
    before = (tmp_path / "run" / "log.jsonl").read_text()
    capsys.readouterr()
    train.main(tiny_args(data_dir, tmp_path / "run", max_iters=2, init_from="resume"))
    out = capsys.readouterr().out
    assert "nothing to train: at iteration 3, max_iters=2" in out and "done:" not in out
    assert (tmp_path / "run" / "log.jsonl").read_text() == before


@pytest.mark.parametrize("first,then", [("bfloat16", "float16"), ("float16", "bfloat16")])
def test_resume_across_precisions(data_dir, tmp_path, first, then):
    """An A100 run (bfloat16, no GradScaler state) resumed on a V100 (float16), and back."""
    out = tmp_path / "run"
    train.main(tiny_args(data_dir, out, max_iters=3, dtype=first))
    train.main(tiny_args(data_dir, out, dtype=then, init_from="resume"))
    steps = [e for e in log_entries(out) if "loss" in e]
    assert [e["iter"] for e in steps] == list(range(6))
    assert all(("grad_scale" in e) == (dtype == "float16")
               for e, dtype in zip(steps, [first] * 3 + [then] * 3))
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 6


def test_resume_takes_this_runs_fused_choice(data_dir, tmp_path):
    """optimizer.load_state_dict brings back the saved run's `fused`, e.g. an MPS run's False, which
    a CUDA or CPU run, fused since the optimizer was made, must not take: the resumed run puts
    back its own choice."""
    out = tmp_path / "run"
    train.main(tiny_args(data_dir, out, max_iters=3))
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert [g["fused"] for g in ckpt["optimizer"]["param_groups"]] == [True, True]  # CPU: fused
    for group in ckpt["optimizer"]["param_groups"]:
        group["fused"] = False
    torch.save(ckpt, out / "ckpt.pt")
    train.main(tiny_args(data_dir, out, init_from="resume", dtype="float16"))
    groups = torch.load(out / "ckpt.pt", weights_only=True)["optimizer"]["param_groups"]
    assert [g["fused"] for g in groups] == [True, True]


def test_resume_refuses_a_dataset_with_another_tokenizer(data_dir, tmp_path):
    train.main(tiny_args(data_dir, tmp_path / "run", max_iters=3))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "a.txt").write_text("0123456789 " * 500)
    prepare_data.main(["--dataset", "files", "--path", str(tmp_path / "other"),
                       "--out_dir", str(tmp_path / "d2")])
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(tmp_path / "d2", tmp_path / "run", init_from="resume"))
    assert ("was trained on tokenizer" in str(e.value.code)
            and str(tmp_path / "d2") in str(e.value.code))


def test_a_mixed_dataset_is_refused(data_dir, tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(data_dir, mixed)
    meta = json.loads((mixed / "meta.json").read_text())
    val = mixed / meta["files"]["val"]["file"]
    val.write_bytes(val.read_bytes()[::-1])  # the same size, other content
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(mixed, tmp_path / "run"))
    assert ("do not belong together" in str(e.value.code)
            and not (tmp_path / "run" / "log.jsonl").exists())


@pytest.mark.parametrize("argv,message", [
    (["--learning_rate=nan"], "learning_rate=nan is not allowed: must be a finite number > 0"),
    (["--learning_rate=-0.1"], "learning_rate=-0.1 is not allowed"),
    (["--beta1=1.0"], "beta1=1.0 is not allowed: must be in [0, 1)"),
    (["--beta2=-0.5"], "beta2=-0.5 is not allowed"),
    (["--max_iters=-1"], "max_iters=-1 is not allowed"),
    (["--device=bogus"], "device='bogus' is not allowed: must be auto, cpu, cuda, cuda:N or mps"),
])
def test_bad_values_are_one_line_errors(data_dir, tmp_path, argv, message):
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(data_dir, tmp_path / "x") + argv)
    assert message in str(e.value.code) and not (tmp_path / "x").exists()


@pytest.mark.parametrize("content,message", [
    (b"n_layer = 4\nn_head = (4\n", "line 2: '(' was never closed"),
    (b"n_layer = 4\n# caf\xe9\n", "line 2: byte 0xe9 is not UTF-8 text"),
    (b"n_layer = 4\nn_head = heads\n", "line 2: NameError: name 'heads' is not defined"),
])
def test_broken_config_files_name_the_line(tmp_path, content, message):
    bad = tmp_path / "bad.py"
    bad.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        train.main([str(bad)])
    assert f"config file {bad}, {message}" in str(e.value.code)


def test_out_dir_that_cannot_take_checkpoints_fails_before_training(data_dir, tmp_path,
                                                                    monkeypatch):
    (tmp_path / "file").write_text("")
    for out in (tmp_path / "file", tmp_path / "file" / "run"):
        with pytest.raises(SystemExit) as e:
            train.main(tiny_args(data_dir, out))
        assert "is a file, not a directory" in str(e.value.code)
    monkeypatch.setattr(train, "GPT", None)  # proves no model is built before the error
    from lexgpt import outputs

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(outputs.tempfile, "TemporaryFile", refuse)
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(data_dir, tmp_path / "locked"))
    assert ("out_dir" in str(e.value.code)
            and "is not writable: Permission denied" in str(e.value.code))
    # made for this run, never owned: removed all the same
    assert not (tmp_path / "locked").exists()


# --- MFU, reading the loss at log steps only, compile, wandb --------------------------------------


def test_mfu_is_the_model_flops_over_time_and_peak(data_dir, tmp_path, monkeypatch, capsys):
    from lexgpt.mfu import train_flops_per_token

    monkeypatch.setattr(train, "peak_flops", lambda device, dtype: 1e9)
    train.main(tiny_args(data_dir, tmp_path / "run"))
    steps = read_log(tmp_path / "run")[0]
    model_args = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)["model_args"]
    flops = train_flops_per_token(GPTConfig(**model_args))
    for r in steps:
        assert r["mfu"] == pytest.approx(flops * 4 * 16 / (r["ms_per_iter"] / 1e3) / 1e9, rel=1e-9)
    assert f"mfu {steps[-1]['mfu']:.2%}" in capsys.readouterr().out
    monkeypatch.setattr(train, "peak_flops", lambda device, dtype: None)  # a GPU not in the table
    train.main(tiny_args(data_dir, tmp_path / "unknown", max_iters=2))
    assert not any("mfu" in r for r in read_log(tmp_path / "unknown")[0])
    assert "mfu n/a" in capsys.readouterr().out


def test_no_mfu_on_a_cpu(data_dir, tmp_path, capsys):
    """A CPU has no vendor peak, and one measured while other work shares its cores reads low, which
    made MFU read 300-4,000%: train.py reports none there rather than an impossible figure."""
    train.main(tiny_args(data_dir, tmp_path / "run", max_iters=3))
    assert not any("mfu" in r for r in read_log(tmp_path / "run")[0])
    assert "mfu n/a" in capsys.readouterr().out


def test_gradient_norm_and_data_wait_are_logged(data_dir, tmp_path):
    """The first step's gradient norm, before clipping, equals one computed here by hand from the
    same weights and batch; the share of the step spent reading data is a fraction."""
    from lexgpt.data import load_meta, read_tokens

    train.main(tiny_args(data_dir, tmp_path / "run", max_iters=2, grad_clip=0.5))
    first = read_log(tmp_path / "run")[0][0]
    c = train.load_config(tiny_args(data_dir, tmp_path / "run"))
    torch.manual_seed(c.seed)
    model = GPT(GPTConfig(vocab_size=load_meta(data_dir)["vocab_size"],
                          **{k: getattr(c, k) for k in train_setup.MODEL_KEYS}))
    tokens = read_tokens(data_dir, "train", load_meta(data_dir))
    offsets = train.sample_offsets(c.seed, 0, 0, tokens, c.batch_size, c.block_size)
    model(*train.get_batch(tokens, offsets, c.block_size, "cpu"))[1].backward()
    want = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    # clipped after
    assert first["iter"] == 0 and first["grad_norm"] == pytest.approx(want, rel=1e-5) and want > 0.5
    assert all(0 <= r["data_wait"] <= 1 for r in read_log(tmp_path / "run")[0])


def test_grad_checkpoint_equals_the_plain_step(data_dir, tmp_path):
    """Activation checkpointing recomputes the blocks in the backward pass: the same loss and
    gradients as the plain step (model), and the same training log (train.py)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=11, n_layer=3, n_head=2, n_embd=32,
                          dropout=0.0)).train()
    x, y = torch.randint(0, 11, (2, 3, 16))
    grads = []
    for on in (False, True):
        model.grad_checkpoint = on
        model.zero_grad()
        loss = model(x, y)[1]
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(grads[0][0], grads[1][0])
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    train.main(tiny_args(data_dir, tmp_path / "plain"))
    train.main(tiny_args(data_dir, tmp_path / "recomputed", grad_checkpoint=True))
    plain, recomputed = log_entries(tmp_path / "plain"), log_entries(tmp_path / "recomputed")
    assert [e.keys() for e in plain] == [e.keys() for e in recomputed]
    for a, b in zip(plain, recomputed):
        assert all(a[k] == pytest.approx(b[k], rel=1e-5) for k in a)


def test_keep_checkpoints_keeps_the_latest_k_and_the_best(data_dir, tmp_path):
    out = tmp_path / "run"
    train.main(tiny_args(data_dir, out, max_iters=8, eval_interval=2, keep_checkpoints=2))
    kept = sorted(p.name for p in out.glob("ckpt*.pt"))
    assert kept == ["ckpt.pt", "ckpt_0000006.pt", "ckpt_0000008.pt", "ckpt_best.pt"]
    def load(name):
        return torch.load(out / name, weights_only=True)
    assert load("ckpt_0000006.pt")["iter_num"] == 6 and load("ckpt_0000008.pt")["iter_num"] == 8
    evals = {e["iter"]: e["val_loss"] for e in read_log(out)[1] if e["iter"] > 0}
    best_iter = min(evals, key=evals.get)
    assert load("ckpt_best.pt")["iter_num"] == best_iter
    assert load("ckpt_best.pt")["best_val_loss"] == pytest.approx(evals[best_iter])
    # a fresh run drops the old ones at once
    train.main(tiny_args(data_dir, out, max_iters=2, overwrite=True))
    assert sorted(p.name for p in out.glob("ckpt*.pt")) == ["ckpt.pt"]


def test_a_fresh_run_removes_only_its_own_checkpoints(data_dir, tmp_path):
    """A user's file named like a checkpoint survives a fresh run; an earlier run's kept checkpoints
    without its ckpt.pt are refused with one line, and removed only with overwrite=True."""
    out = tmp_path / "run"
    train.main(tiny_args(data_dir, out, max_iters=2))
    (out / "ckpt.pt").rename(out / "ckpt_backup.pt")
    train.main(tiny_args(data_dir, out, max_iters=2))
    assert sorted(p.name for p in out.glob("ckpt*.pt")) == ["ckpt.pt", "ckpt_backup.pt"]
    (out / "ckpt.pt").rename(out / "ckpt_best.pt")
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(data_dir, out, max_iters=2))
    assert (f"{out} holds an earlier run's ckpt_best.pt, which init_from=scratch would remove"
            in str(e.value.code))
    assert sorted(p.name for p in out.glob("ckpt*.pt")) == ["ckpt_backup.pt", "ckpt_best.pt"]
    train.main(tiny_args(data_dir, out, max_iters=2, overwrite=True))
    assert sorted(p.name for p in out.glob("ckpt*.pt")) == ["ckpt.pt", "ckpt_backup.pt"]


def test_checkpoint_minutes_writes_at_log_steps(data_dir, tmp_path, monkeypatch):
    written = []
    real = train.save_checkpoint
    monkeypatch.setattr(train, "save_checkpoint",
                        lambda obj, path: written.append(obj["iter_num"]) or real(obj, path))
    train.main(tiny_args(data_dir, tmp_path / "run", max_iters=6, eval_interval=100,
                         checkpoint_minutes=1e-9))
    assert written == [1, 2, 3, 4, 5, 6]  # after every iteration (log_interval=1), and at the end
    written.clear()
    train.main(tiny_args(data_dir, tmp_path / "off", max_iters=6, eval_interval=100))
    assert written == [6]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_saves_and_the_resume_is_exact(data_dir, tmp_path, sig):
    """A scheduler's SIGTERM (or SLURM's SIGUSR1 warning) mid-run: the process writes the checkpoint
    at its next log step and stops with one line; resumed, it logs exactly what the uninterrupted
    run logs. (400 iterations: the signal comes seconds before the run's end, even
    on a busy machine.)"""
    args = dict(max_iters=400, eval_interval=100, eval_iters=2)
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", *tiny_args(data_dir, out, **args)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        while proc.poll() is None and not ((out / "log.jsonl").exists()
                                           and any(i >= 5 for i in logged_iters(out))):
            time.sleep(0.01)
        assert proc.poll() is None, "training ended before the signal"
        proc.send_signal(sig)
        stderr = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    assert proc.returncode == 1 and "Traceback" not in stderr
    assert f"stopped by {sig.name} after iter" in stderr and len(stderr.strip().splitlines()) == 1
    saved = torch.load(out / "ckpt.pt", weights_only=True)["iter_num"]
    assert 5 < saved < 400 and f"after iter {saved - 1}:" in stderr
    assert_resume_equals_straight(cmd, out, data_dir, tmp_path, args)


def test_loss_is_read_at_log_steps_only(data_dir, tmp_path, monkeypatch):
    """Each logged loss is its own iteration's, and the all-reduce (where the host waits for the
    device) runs at log steps and evaluations only."""
    train.main(tiny_args(data_dir, tmp_path / "every"))
    reduced, real = [], train.all_reduce_sum
    monkeypatch.setattr(train, "all_reduce_sum",
                        lambda t, ddp: reduced.append(t.numel()) or real(t, ddp))
    train.main(tiny_args(data_dir, tmp_path / "third", log_interval=3))
    assert losses(tmp_path / "third") == losses(tmp_path / "every")[::3]
    assert [r["iter"] for r in read_log(tmp_path / "third")[0]] == [0, 3]
    # 3 evaluations of 2 splits (sum, count), each before its iteration's log step (loss, non-finite
    # flag, gradient norm, and the two flags that decide a checkpoint and a stop
    # on every rank alike)
    assert reduced == [2, 2, 5, 2, 2, 5, 2, 2]


def test_one_iteration_reads_in_train_py(data_dir, tmp_path):
    """One training iteration, from one optimizer step to the next (the second to the third, with a
    log step and no evaluation between): the repository files whose code it runs (sys.settrace's
    call events), besides train.py and the method (model.py, alternatives.py), are at most 2."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    entered, steps, previous = set(), [], sys.gettrace()

    def trace(frame, event, arg):  # the global trace function: called as each new frame starts
        path = Path(frame.f_code.co_filename)
        # (after_step)
        if ROOT in path.parents and ".venv" not in path.parts and path != Path(__file__).resolve():
            entered.add(path.relative_to(ROOT).as_posix())

    def after_step(optimizer, args, kwargs):
        steps.append(1)
        sys.settrace(trace if len(steps) == 2 else previous)

    hook = register_optimizer_step_post_hook(after_step)
    try:
        train.main(tiny_args(data_dir, tmp_path / "run", max_iters=3, eval_interval=3,
                             log_interval=1))
    finally:
        hook.remove()
        sys.settrace(previous)
    assert len(steps) == 3 and {"train.py", "model.py"} <= entered
    others = sorted(entered - {"train.py", "model.py", "alternatives.py"})
    print(f"one iteration also enters: {others}")
    assert len(others) <= 2, others


def test_non_finite_loss_between_log_steps_stops_at_the_next(data_dir, tmp_path, monkeypatch):
    out = tmp_path / "nan"
    train.main(tiny_args(data_dir, out, max_iters=3, log_interval=2))
    good = (out / "ckpt.pt").read_bytes()
    forward = GPT.forward

    def poisoned(self, idx, targets=None, **kw):  # from iter 3 on (the resumed run's first step)
        logits, loss = forward(self, idx, targets, **kw)
        return logits, (loss * float("nan") if self.training else loss)

    monkeypatch.setattr(GPT, "forward", poisoned)
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(data_dir, out, init_from="resume", log_interval=2))
    # iter 3 is not a log step: caught at iter 4
    assert "non-finite loss at iter 3" in str(e.value.code)
    assert (out / "ckpt.pt").read_bytes() == good


def test_float16_skipped_steps_are_counted_over_the_whole_run(data_dir, tmp_path, monkeypatch):
    """An inf loss at iter 1 (not a log step): the GradScaler skips that step (fused AdamW applies
    no update), halves its scale, and training goes on. skipped_steps counts from the run's
    start, across a resume."""
    forward, calls = GPT.forward, []

    def inf_at_iter_1(self, idx, targets=None, **kw):
        logits, loss = forward(self, idx, targets, **kw)
        calls.append(self.training)
        return logits, (loss * float("inf") if self.training and calls.count(True) == 2 else loss)

    monkeypatch.setattr(GPT, "forward", inf_at_iter_1)
    args = dict(dtype="float16", log_interval=2)
    train.main(tiny_args(data_dir, tmp_path / "straight", **args))
    steps = read_log(tmp_path / "straight")[0]
    assert [(r["iter"], r["skipped_steps"]) for r in steps] == [(0, 0), (2, 1), (4, 1)]
    assert (steps[1]["grad_scale"] == steps[0]["grad_scale"] / 2
            and all(math.isfinite(r["loss"]) for r in steps))
    calls.clear()
    train.main(tiny_args(data_dir, tmp_path / "halves", max_iters=3, **args))
    train.main(tiny_args(data_dir, tmp_path / "halves", init_from="resume", **args))
    assert log_entries(tmp_path / "halves") == log_entries(tmp_path / "straight")


@pytest.mark.slow
def test_compile(data_dir, tmp_path):
    """torch.compile on CPU (inductor builds C++ kernels with the system's compiler): about 30 s
    cold on 2 CPU cores, a few seconds once inductor's cache (/tmp/torchinductor_$USER)
    holds its kernels."""
    train.main(tiny_args(data_dir, tmp_path / "run", max_iters=3, compile=True))
    steps, evals = read_log(tmp_path / "run")
    assert [r["iter"] for r in steps] == [0, 1, 2] and all(math.isfinite(r["loss"]) for r in steps)
    assert [r["iter"] for r in evals] == [0, 3] and all(math.isfinite(r["val_loss"]) for r in evals)
    weights = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)["model"]
    assert not any(k.startswith("_orig_mod.") for k in weights)


def test_wandb_log_without_wandb_is_a_one_line_error(data_dir, tmp_path, monkeypatch):
    # import wandb now fails, as when it is not installed
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(data_dir, tmp_path / "run", wandb_log=True))
    assert (e.value.code
            == "train.py: error: wandb_log=True needs the wandb package: pip install wandb")
    assert not (tmp_path / "run" / "ckpt.pt").exists()


def test_wandb_offline(data_dir, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed (it is optional)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logged, real = [], wandb.Run.log
    monkeypatch.setattr(wandb.Run, "log",
                        lambda run, data, *a, **kw: logged.append(data)
                        or real(run, data, *a, **kw))
    train.main(tiny_args(data_dir, tmp_path / "run", wandb_log=True, wandb_run_name="tiny"))
    steps, evals = read_log(tmp_path / "run")
    assert logged == [{"iter": e["iter"], "train/loss": e["train_loss"], "val/loss": e["val_loss"],
                       "lr": train.get_lr(e["iter"],
                                          train.load_config(tiny_args(data_dir, tmp_path)))}
                      if "val_loss" in e
                      else {k: e[k] for k in ("iter", "loss", "lr", "grad_norm", "data_wait")}
                      for e in (json.loads(line) for line in
                                (tmp_path / "run" / "log.jsonl").read_text().splitlines())]
    assert (len(logged) == len(steps) + len(evals)
            and list((tmp_path / "wandb").glob("offline-run-*")))


def train_error(argv):
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert str(e.value.code).startswith("train.py: error: ") and "\n" not in str(e.value.code)
    return str(e.value.code)


@pytest.mark.parametrize("override, message", [
    (dict(seed=-1), "config key seed=-1 is not allowed: must be an integer from 0 to 2**63 - 1"),
    (dict(seed=10**23), f"config key seed={10**23} is not allowed"),
    (dict(xpos_gamma="inf"),
     "GPTConfig.xpos_gamma=inf is not allowed: must be a finite number > 0"),
    (dict(rope_base="inf"), "GPTConfig.rope_base=inf is not allowed: must be a finite number > 1"),
])
def test_seeds_and_extreme_floats_are_refused_before_any_work(data_dir, tmp_path, override,
                                                              message):
    assert message in train_error(tiny_args(data_dir, tmp_path / "run", **override))
    assert not (tmp_path / "run" / "ckpt.pt").exists()


def test_an_extreme_xpos_scale_base_trains_finite(data_dir, tmp_path):
    """xpos_scale_base=1e-30: every factor stays representable (one query per attention
    call, far keys at 0)."""
    train.main(tiny_args(data_dir, tmp_path / "run", max_iters=2, xpos_scale_base=1e-30))
    steps, evals = read_log(tmp_path / "run")
    assert (steps and all(math.isfinite(r["loss"]) for r in steps)
            and all(math.isfinite(r["val_loss"]) for r in evals))


def test_unusable_out_dirs_are_one_line_errors(data_dir, tmp_path):
    assert "File name too long" in train_error(tiny_args(data_dir, tmp_path / ("x" * 300)))
    (tmp_path / "d" / "ckpt.pt").mkdir(parents=True)
    assert ("ckpt.pt is a directory, not a checkpoint"
            in train_error(tiny_args(data_dir, tmp_path / "d", overwrite=True)))
    assert not (tmp_path / "d" / "log.jsonl").exists()  # refused before any work
    # a symbolic link to itself: it was reported as "a file"
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    message = train_error(tiny_args(data_dir, tmp_path / "loop"))
    assert "Too many levels of symbolic links" in message and "is a file" not in message


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(data_dir, tmp_path, monkeypatch):
    from lexgpt import checkpoint
    out = tmp_path / "run"
    train.main(tiny_args(data_dir, out, max_iters=3))
    before = (out / "ckpt.pt").read_bytes()

    def disk_full(obj, f):
        open(f, "wb").write(b"part of a checkpoint")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    message = train_error(tiny_args(data_dir, out, init_from="resume"))
    assert "could not write checkpoint" in message and "No space left on device" in message
    assert (out / "ckpt.pt").read_bytes() == before and not (out / "ckpt.pt.tmp").exists()


@pytest.mark.slow
def test_resume_refuses_a_damaged_checkpoint(data_dir, tmp_path):
    from lexgpt.checkpoint import save_checkpoint
    from test_common import damage_record
    out = tmp_path / "run"
    train.main(tiny_args(data_dir, out, max_iters=3))
    good = torch.load(out / "ckpt.pt", weights_only=True)
    save_checkpoint(dict(good, iter_num="3"), out / "ckpt.pt")
    assert ("its iter_num '3' is not an integer >= 0"
            in train_error(tiny_args(data_dir, out, init_from="resume")))
    save_checkpoint(good, out / "ckpt.pt")
    import zipfile
    # the largest record: the optimizer's moments or the embedding
    with zipfile.ZipFile(out / "ckpt.pt") as z:
        names = [i.filename.split("/", 1)[1] for i in z.infolist() if "/data/" in i.filename]
    # damage each record in turn: the resume (which checks every part) refuses it
    for name in names:
        save_checkpoint(good, out / "ckpt.pt")
        damage_record(out / "ckpt.pt", name, at=0)
        assert "ckpt.pt is damaged" in train_error(tiny_args(data_dir, out, init_from="resume"))

def hold_lock(out_dir, owner="pid 4242 on host elsewhere (train.py)"):
    """out_dir's lock held as a running train.py holds it (flock on out_dir/lock, its owner written
    in): the caller closes the descriptor to let go."""
    import fcntl
    fd = os.open(Path(out_dir) / "lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, owner.encode())
    return fd


def test_a_second_trainer_on_an_owned_out_dir_is_refused(data_dir, tmp_path):
    """Two trainers on one out_dir renamed each other's ckpt.pt.tmp away: the second (resume, or
    scratch with --overwrite=True) is now a one-line error naming the owner, and touches nothing; a
    dead owner's lock is taken."""
    out = tmp_path / "run"
    train.main(tiny_args(data_dir, out, max_iters=3))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    fd = hold_lock(out)
    try:
        for extra in (dict(init_from="resume"), dict(overwrite=True)):
            with pytest.raises(SystemExit) as e:
                train.main(tiny_args(data_dir, out, **extra))
            assert str(e.value.code) == (f"train.py: error: out_dir {out} is in use by pid 4242 on "
                                         "host elsewhere (train.py): one process at a time writes "
                                         "a run; wait for it to end or stop it, "
                                         "or give another out_dir")
            assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != "lock"} == before
    finally:
        os.close(fd)  # the owner dies: its lock file stays behind, stale
    train.main(tiny_args(data_dir, out, init_from="resume"))
    assert (torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 6
            and not (out / "lock").exists())


def test_a_refused_trainer_leaves_the_owners_new_log(data_dir, tmp_path):
    """The owner of an out_dir, just started with --overwrite=True, holds an empty log.jsonl beside
    no checkpoint: a second trainer refused there took that for its own debris and removed it, and
    the owner's whole log went with it (a race the hostile script's overwrite attack met). A refused
    trainer touches nothing."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "log.jsonl").touch()  # the owner's, as start_log leaves it before the first step
    fd = hold_lock(out)
    try:
        for extra in (dict(init_from="resume"), dict(overwrite=True), dict()):
            message = train_error(tiny_args(data_dir, out, **extra))
            assert message.startswith(f"train.py: error: out_dir {out} is in use by pid 4242 on "
                                      "host elsewhere")
            assert sorted(p.name for p in out.iterdir()) == ["lock", "log.jsonl"]
    finally:
        os.close(fd)


def test_rank_alone_and_a_missing_peer_are_one_line_errors(data_dir, tmp_path, monkeypatch):
    """`RANK=0 python train.py` was a ValueError traceback, and a rank 0 whose peer never comes
    waited for ever (30 minutes): one-line errors, the second after ddp_rendezvous_minutes, naming
    the missing rank."""
    monkeypatch.setenv("RANK", "0")
    for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(data_dir, tmp_path / "run"))
    assert str(e.value.code).startswith("train.py: error: RANK='0' is set but not WORLD_SIZE, "
                                        "MASTER_ADDR, MASTER_PORT")
    from test_common import torchrun_vars
    torchrun_vars(monkeypatch, 0)
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(data_dir, tmp_path / "run", ddp_rendezvous_minutes=0.01))
    assert ("rank(s) 1 of WORLD_SIZE=2 did not join" in str(e.value.code)
            and "\n" not in str(e.value.code))
    assert not (tmp_path / "run").exists()


def sigint_default():
    """A child's SIGINT as in a terminal: a background test run (make test-all &)
    would pass on SIG_IGN."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_is_one_line_and_keeps_the_last_checkpoint(data_dir, tmp_path):
    """SIGINT (Ctrl-C) mid-run printed a KeyboardInterrupt traceback: one line saying which
    checkpoint is kept and how to go on, exit status 130; the checkpoint is the last one written,
    and the run resumes from it."""
    args = dict(max_iters=400, eval_interval=4, eval_iters=2)
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", *tiny_args(data_dir, out, **args)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, preexec_fn=sigint_default)
    try:
        while proc.poll() is None and not ((out / "log.jsonl").exists()
                                           and any(i >= 6 for i in logged_iters(out))):
            time.sleep(0.01)
        assert proc.poll() is None, "training ended before the signal"
        proc.send_signal(signal.SIGINT)
        stderr = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    saved = torch.load(out / "ckpt.pt", weights_only=True)["iter_num"]
    assert (proc.returncode == 130 and "Traceback" not in stderr
            and len(stderr.strip().splitlines()) == 1)
    assert stderr.strip() == (f"train.py: interrupted (Ctrl-C): {out / 'ckpt.pt'} (iter {saved}) "
                              "is kept: continue with --init_from=resume")
    assert not (out / "lock").exists() or "pid" in (out / "lock").read_text()
    done = subprocess.run([*cmd, "--max_iters=12", "--init_from=resume"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_under_torchrun_an_error_is_printed_once(data_dir, tmp_path):
    """Every rank checks the same arguments: the error is printed by rank 0 alone, and the others
    exit with it. One that rank 0 alone meets (out_dir owned by another process) stops every rank,
    printed once too."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", "train.py"]
    done = subprocess.run([*torchrun, *tiny_args(data_dir, tmp_path / "a", batch_size=0)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert (done.returncode != 0
            and done.stderr.count("batch_size=0 is not allowed") == 1), done.stderr
    out = tmp_path / "b"
    out.mkdir()
    fd = hold_lock(out)
    try:
        done = subprocess.run([*torchrun, *tiny_args(data_dir, out, gradient_accumulation_steps=2)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    finally:
        os.close(fd)
    assert (done.returncode != 0
            and done.stderr.count(f"train.py: error: out_dir {out} is in use by pid 4242") == 1)
    ours = ("train.py", "train_setup.py", "distributed.py", "run_dir.py", "cli.py")
    assert not any(f'{name}", line' in done.stderr for name in ours), done.stderr  # (torchrun's
    # own traceback, ChildFailedError, is torchrun's)


def test_a_failed_start_leaves_no_debris(data_dir, tmp_path):
    """A configuration error, or task records of another length, stops before anything stays in
    out_dir: the folder this run made is gone, and no empty log.jsonl is left
    (issue 33, finding 26)."""
    assert ("must be divisible by n_head=3"
            in train_error(tiny_args(data_dir, tmp_path / "a", n_head=3)))
    assert not (tmp_path / "a").exists()
    prepare_data.main(["--dataset", "task", "--tasks", "copy", "--block_size", "32",
                       "--records", "40", "--out_dir", str(tmp_path / "t32")])
    message = train_error(tiny_args(tmp_path / "t32", tmp_path / "b", block_size=64))
    assert ("holds task records of 33 tokens, made for block_size 32: train with --block_size=32"
            in message)
    assert not (tmp_path / "b").exists()
    (tmp_path / "c").mkdir()  # a folder the user made stays, empty as it was
    train_error(tiny_args(tmp_path / "t32", tmp_path / "c", block_size=64))
    assert (tmp_path / "c").is_dir() and not any((tmp_path / "c").iterdir())


def test_resuming_on_task_records_of_another_length_names_the_data(data_dir, tmp_path, capsys):
    """Resuming a task run on another block_size's records: one line naming the data it was trained
    on, not "block_size=96 ignored" followed by "train with --block_size=96"
    (issue 33, finding 25)."""
    for size in (32, 96):
        prepare_data.main(["--dataset", "task", "--tasks", "copy", "--block_size", str(size),
                           "--records", "40", "--out_dir", str(tmp_path / f"t{size}")])
    train.main(tiny_args(tmp_path / "t32", tmp_path / "run", block_size=32, max_iters=2))
    log = (tmp_path / "run" / "log.jsonl").read_text()
    message = train_error(tiny_args(tmp_path / "t96", tmp_path / "run", block_size=96, max_iters=4,
                                    init_from="resume"))
    assert message == (f"train.py: error: {tmp_path / 't96'} holds task records of 97 tokens, made "
                       f"for block_size 96, and {tmp_path / 'run' / 'ckpt.pt'} was trained at "
                       f"block_size=32: resume on the data it was trained on ({tmp_path / 't32'})")
    assert (tmp_path / "run" / "log.jsonl").read_text() == log  # the run is as it was


@pytest.mark.slow
def test_compile_without_a_compiler_is_one_line(data_dir, tmp_path):
    """--compile=True where no C++ compiler is on PATH (a slim image): one line before any work, not
    inductor's hundred-line error at the first step, and no out_dir left (issue 33, finding 17)."""
    env = {"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, str(ROOT / "train.py"),
                           *tiny_args(data_dir, tmp_path / "run", compile=True)],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.strip() == (
        "train.py: error: compile=True on CPU needs a C++ compiler (g++, or $CXX) on PATH and none "
        "works here: install one, or train with --compile=False")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_compile_failure_at_the_first_step_is_one_line(data_dir, tmp_path, monkeypatch):
    """torch.compile's own errors (dynamo, inductor) at the first step: one line saying to train
    without it, and no empty log.jsonl left beside no checkpoint."""
    class BackendFailure(RuntimeError):
        pass
    BackendFailure.__module__ = "torch._dynamo.exc"

    def broken(*a, **k):
        raise BackendFailure("backend='inductor' raised:\nInvalidCxxCompiler: No working C++ "
                             "compiler found")
    # the first call of the compiled model: at iteration 0
    monkeypatch.setattr(train, "evaluate", broken)
    message = train_error(tiny_args(data_dir, tmp_path / "run", compile=True))
    assert message == ("train.py: error: torch.compile failed (BackendFailure: backend='inductor' "
                       "raised:); train with --compile=False")
    assert not (tmp_path / "run").exists()


# --- fine-tuning from another run's checkpoint (init_from=<path>) ---------------------------------


@pytest.fixture(scope="module")
def source_run(data_dir, tmp_path_factory):
    """A RoPE run at block_size 16, the source of the fine-tunes below."""
    out = tmp_path_factory.mktemp("source") / "rope"
    train.main(tiny_args(data_dir, out, pos="rope"))
    return out / "ckpt.pt"


def test_a_fine_tune_starts_from_the_weights_at_a_new_length_with_its_scaling(data_dir, tmp_path,
                                                                              source_run, capsys):
    """A new run: the source's weights (its first evaluation is the source model's, scaled, at 32),
    a fresh optimizer and schedule from iteration 0, the scaling in the model's configuration with
    the source's length as the original, and the source recorded in every checkpoint; a resumed
    fine-tune equals the uninterrupted one."""
    ft = dict(pos="rope", block_size=32, rope_scaling="yarn", rope_factor=2.0, init_from=source_run,
              dropout=0.1, eval_interval=100)
    train.main(tiny_args(data_dir, tmp_path / "straight", **ft))
    assert "fine-tuning" in capsys.readouterr().out
    ckpt = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=False)
    source = torch.load(source_run, weights_only=False)
    assert ckpt["model_args"] | dict(block_size=16, rope_scaling="none", rope_factor=1.0,
                                     rope_original_length=0, dropout=0.0) == source["model_args"]
    assert (ckpt["model_args"]["block_size"], ckpt["model_args"]["rope_scaling"],
            ckpt["model_args"]["rope_factor"],
            ckpt["model_args"]["rope_original_length"]) == (32, "yarn", 2.0, 16)
    assert ckpt["iter_num"] == 6 and ckpt["init"]["path"] == str(source_run.resolve())
    assert (ckpt["init"]["iter_num"] == source["iter_num"]
            and ckpt["init"]["config"] == source["config"])
    # its first evaluation is the source's weights under YaRN at s = 2, from 16, at block_size 32
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(source["model"])
    first = read_log(tmp_path / "straight")[1][0]
    assert (first["iter"] == 0
            and first["val_loss"] == pytest.approx(val_loss(model, data_dir, 32), rel=1e-5))
    # a fresh schedule: warmup from iteration 0 again
    assert read_log(tmp_path / "straight")[0][0]["lr"] == pytest.approx(1e-2 / 3)
    # stopped half-way and resumed: the same run
    train.main(tiny_args(data_dir, tmp_path / "halves", **(ft | dict(max_iters=3))))
    train.main(tiny_args(data_dir, tmp_path / "halves", **(ft | dict(init_from="resume"))))
    assert losses(tmp_path / "halves") == losses(tmp_path / "straight")
    resumed = torch.load(tmp_path / "halves" / "ckpt.pt", weights_only=False)
    assert all(torch.equal(resumed["model"][k], ckpt["model"][k]) for k in ckpt["model"])
    assert resumed["init"] == ckpt["init"]


def val_loss(model, data_dir, block_size):
    """train.evaluate's val loss, computed here from its batches (seed 1337, stream 2,
    eval_iters 2, batch 4)."""
    from lexgpt.data import get_batch, load_meta, read_tokens, sample_offsets
    meta = load_meta(data_dir)
    data = read_tokens(data_dir, "val", meta)
    model.eval()
    with torch.no_grad():
        return sum(model(*get_batch(data, sample_offsets(1337, 2, k, data, 4, block_size),
                                    block_size, "cpu"))[1].item()
                   for k in range(2)) / 2


def test_fine_tune_errors(data_dir, tmp_path, source_run):
    learned = tmp_path / "learned"
    train.main(tiny_args(data_dir, learned, pos="learned", max_iters=1))
    for overrides, message in (
            (dict(init_from=tmp_path / "nothing.pt"),
             "is not allowed: scratch, resume, or the path of a checkpoint"),
            (dict(init_from=learned / "ckpt.pt", block_size=32),
             "pos='learned', a table of 16 positions"),
            (dict(init_from=source_run, rope_scaling="pi"),
             "rope_factor=1.0 is not allowed: must be a finite number"),
            (dict(init_from=source_run, rope_scaling="dynamic_ntk"),
             "must be one of none, pi, ntk, yarn"),
            (dict(init_from=learned / "ckpt.pt", out_dir=learned), "is in out_dir")):
        argv = tiny_args(data_dir, overrides.pop("out_dir", tmp_path / "ft"), **overrides)
        with pytest.raises(SystemExit) as e:
            train.main(argv)
        assert message in str(e.value.code) and "\n" not in str(e.value.code)
        assert not (tmp_path / "ft").exists()
    assert (learned / "ckpt.pt").exists()
    # an out_dir with a run in it is not replaced by a fine-tune either
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(data_dir, learned, init_from=source_run))
    assert "exists and init_from=" in str(e.value.code)


@pytest.mark.slow
def test_a_fine_tune_under_torchrun_matches_one_process(data_dir, tmp_path, source_run):
    """Every rank reads the source; two gloo processes fine-tune as one does."""
    ft = dict(pos="rope", block_size=32, rope_scaling="pi", rope_factor=2.0, init_from=source_run,
              gradient_accumulation_steps=2)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", "train.py", *tiny_args(data_dir, tmp_path / "ddp", **ft)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    train.main(tiny_args(data_dir, tmp_path / "single", **ft))
    ddp, single = read_log(tmp_path / "ddp"), read_log(tmp_path / "single")
    assert (len(ddp[0]) == 6
            and max(abs(a["loss"] - b["loss"]) for a, b in zip(ddp[0], single[0])) < 1e-5)
    assert (torch.load(tmp_path / "ddp" / "ckpt.pt", weights_only=False)["init"]["path"]
            == str(source_run.resolve()))


# --- issue 45: help, notes, the RoPE keys, the tokenizer and data_dir of a checkpoint -------------


def test_help_lists_every_key_with_its_default_and_meaning(capsys):
    """--help and -h: every TrainConfig key as --key=default, which reads back as the default, and
    a meaning beside it; status 0 (main returns), nothing trained (issue 45, item 21)."""
    from dataclasses import fields
    for flag in ("--help", "-h"):
        train.main(["--max_iters=3", flag])
        out = capsys.readouterr().out
        assert out.startswith("usage: ") and "config" in out.splitlines()[0]
        lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  --")}
        for f in fields(train.TrainConfig):
            shown = next(k for k in lines if k.partition("=")[0] == f"--{f.name}")
            assert getattr(train.load_config([shown]), f.name) == f.default, shown
            assert len(lines[shown].split(None, 1)) == 2, f"{shown}: no meaning"
        assert len(lines) == len(fields(train.TrainConfig))


def test_notes_name_only_the_keys_the_user_set(data_dir, tmp_path, source_run, capsys):
    """A fine-tune or a resume notes a model key it overrides only when the user set it, in a
    config file or as --key=value: defaults are nobody's choice (issue 45, item 22)."""
    ft = tmp_path / "ft"
    train.main(tiny_args(data_dir, ft, init_from=source_run, max_iters=1))  # pos: default xpos
    out = capsys.readouterr().out
    assert "fine-tuning" in out and "ignored" not in out
    args = [a for a in tiny_args(data_dir, ft, init_from="resume", max_iters=2)
            if not a.startswith("--block_size=")]  # the default 256: the checkpoint's 16 wins
    train.main(args)
    assert "ignored" not in capsys.readouterr().out
    config = tmp_path / "c.py"
    config.write_text("pos = 'xpos'\n")
    train.main([str(config), *tiny_args(data_dir, ft, init_from="resume", max_iters=3,
                                        block_size=64)])
    out = capsys.readouterr().out
    assert ("note: pos='xpos' ignored, the checkpoint has 'rope'" in out
            and "note: block_size=64 ignored, the checkpoint has 16" in out)
    train.main(tiny_args(data_dir, tmp_path / "ft2", init_from=source_run, max_iters=1,
                         pos="alibi"))
    assert f"note: pos='alibi' ignored, {source_run} has 'rope'" in capsys.readouterr().out


def test_a_rope_factor_or_length_without_a_scaling_is_refused(data_dir, tmp_path, source_run):
    """rope_factor or rope_original_length given with rope_scaling=none: one line before any work,
    as the evaluation scripts refuse --rope_factor alone, not a run that trains unscaled and
    records rope_factor=4.0 (issue 45, item 18)."""
    for overrides, message in (
            (dict(init_from=source_run, block_size=64, rope_factor=4),
             "rope_factor=4.0 applies to rope_scaling pi, ntk or yarn only: give --rope_scaling"),
            (dict(pos="rope", rope_factor=2), "rope_factor=2.0 applies to rope_scaling"),
            (dict(init_from=source_run, block_size=64, rope_original_length=16),
             "rope_original_length=16 applies to rope_scaling pi, ntk or yarn only")):
        assert message in train_error(tiny_args(data_dir, tmp_path / "ft", **overrides))
        assert not (tmp_path / "ft").exists()


def test_a_chained_fine_tune_keeps_the_first_original_length(data_dir, tmp_path, source_run):
    """rope_original_length, unless given: the source's own when it was scaled (the length its
    unscaled angles were trained at, as Hugging Face keeps original_max_position_embeddings),
    else the source's block_size (docs/training.md; issue 45, item 6)."""
    def fine_tune(source, out, block_size, scaling):
        train.main(tiny_args(data_dir, out, init_from=source, block_size=block_size,
                             rope_scaling=scaling, rope_factor=2.0 if scaling != "none" else 1.0,
                             max_iters=1))
        args = torch.load(out / "ckpt.pt", weights_only=True)["model_args"]
        return args["block_size"], args["rope_scaling"], args["rope_original_length"]

    assert fine_tune(source_run, tmp_path / "a", 32, "yarn") == (32, "yarn", 16)
    assert fine_tune(tmp_path / "a" / "ckpt.pt", tmp_path / "b", 64, "yarn") == (64, "yarn", 16)
    assert fine_tune(source_run, tmp_path / "c", 32, "none") == (32, "none", 0)
    assert fine_tune(tmp_path / "c" / "ckpt.pt", tmp_path / "d", 64, "pi") == (64, "pi", 32)


def test_a_scaled_fine_tune_below_the_original_length_names_the_users_keys(data_dir, tmp_path,
                                                                           source_run):
    """A scaling extends a model: fine-tuned shorter than its source's length it is refused in
    one line naming block_size and rope_scaling (the user's keys), not rope_original_length
    (which the user never set)."""
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(data_dir, tmp_path / "short", init_from=source_run, block_size=8,
                             rope_scaling="yarn", rope_factor=2.0, max_iters=1))
    assert (f"block_size=8 is below {source_run}'s original length 16: rope_scaling='yarn' "
            "extends a model past the length it was trained at" in str(e.value.code))
    assert not (tmp_path / "short").exists()


def other_characters(root, data_dir):
    """A dataset with as many characters as data_dir's, other ones: its corpus in capitals."""
    (root / "upper").mkdir()
    for f in (data_dir.parent / "corpus").iterdir():
        (root / "upper" / f.name).write_text(f.read_text().upper())
    prepare_data.main(["--dataset", "files", "--path", str(root / "upper"),
                       "--out_dir", str(root / "upper_chars")])
    return root / "upper_chars"


def without_tokenizer(source, path, **config):
    """source re-saved as a checkpoint from before tokenizer records (none), config changed."""
    from lexgpt.checkpoint import save_checkpoint
    ckpt = torch.load(source, weights_only=True)
    del ckpt["tokenizer"], ckpt["checksums"]
    ckpt["config"].update(config)
    ckpt.pop("cwd", None)
    save_checkpoint(ckpt, path)
    return path


def test_a_checkpoint_without_a_tokenizer_takes_its_datasets(data_dir, tmp_path, source_run):
    """A checkpoint that records no tokenizer (an old or a re-saved one) has the tokenizer of the
    dataset it was trained on: a fine-tune or a resume on another one of the same vocab_size is
    refused, so that no run records a tokenizer its weights were not trained with; without that
    dataset there is nothing to check against, and it is refused (issue 45, item 12)."""
    from lexgpt.data import load_meta, tokenizer_identity
    upper = other_characters(tmp_path, data_dir)
    assert load_meta(upper)["vocab_size"] == load_meta(data_dir)["vocab_size"]
    old = without_tokenizer(source_run, tmp_path / "old.pt")
    message = train_error(tiny_args(upper, tmp_path / "ft", init_from=old))
    assert "chars_sha256" in message and str(upper) in message and str(data_dir) in message
    assert not (tmp_path / "ft").exists()
    # on its own dataset: the fine-tune records that dataset's tokenizer
    train.main(tiny_args(data_dir, tmp_path / "ft", init_from=old, max_iters=1))
    ckpt = torch.load(tmp_path / "ft" / "ckpt.pt", weights_only=True)
    assert ckpt["tokenizer"] == tokenizer_identity(load_meta(data_dir))
    # resumed on the other dataset
    run = tmp_path / "run"
    train.main(tiny_args(data_dir, run, pos="rope", max_iters=1))
    without_tokenizer(run / "ckpt.pt", run / "ckpt.pt")
    assert "chars_sha256" in train_error(tiny_args(upper, run, pos="rope", init_from="resume"))
    # the dataset it was trained on is gone: refused, on any dataset
    gone = without_tokenizer(source_run, tmp_path / "gone.pt", data_dir=str(tmp_path / "nowhere"))
    message = train_error(tiny_args(data_dir, tmp_path / "ft2", init_from=gone))
    assert "records no tokenizer" in message and str(tmp_path / "nowhere") in message


def test_a_relative_data_dir_is_found_from_another_directory(data_dir, tmp_path, monkeypatch):
    """A run made in A with data_dir=data (relative): the evaluation scripts, run from B, find A's
    dataset by default; train.py from B with --data_dir=data (not there) names A's dataset instead
    of advising prepare_data.py to build a second one in B (issue 45, item 23)."""
    from lexgpt.checkpoint import load_checkpoint
    from lexgpt.data import checkpoint_dataset
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    os.symlink(data_dir, a / "data")
    monkeypatch.chdir(a)
    train.main(tiny_args("data", "out", pos="rope", max_iters=1))
    monkeypatch.chdir(b)
    ckpt_path = a / "out" / "ckpt.pt"
    found, meta = checkpoint_dataset(load_checkpoint(ckpt_path), ckpt_path)
    assert Path(found).resolve() == data_dir.resolve() and meta["vocab_size"] > 0
    for overrides in (dict(init_from=ckpt_path, out_dir=b / "ft"),
                      dict(init_from="resume", out_dir=a / "out")):
        message = train_error(tiny_args("data", overrides.pop("out_dir"), pos="rope",
                                        **overrides))
        assert (f"relative to {b}" in message and f"--data_dir={a / 'data'}" in message
                and "prepare_data.py" not in message), message
    assert not (b / "ft").exists()
