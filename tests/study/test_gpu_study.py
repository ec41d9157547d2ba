"""make gpu-study on CPU at a toy size: the same recipe as on the GPU (three schemes trained on a
corpus, then perplexity by length, the context probe and the repeat sweep under every rule),
each output checked."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_study_runs_end_to_end_at_a_toy_size(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    subprocess.run([sys.executable, "prepare_data.py", "--dataset", "shakespeare",
                    "--tokenizer", "char", "--out_dir", str(data)], cwd=ROOT, check=True,
                   capture_output=True)
    train = ("--dtype=float32 --compile=False --n_layer=1 --n_head=2 --n_embd=16 "
             "--block_size=16 --batch_size=2 --max_iters=2 --lr_decay_iters=2 --warmup_iters=1 "
             "--eval_iters=1 --eval_interval=2")
    done = subprocess.run(["make", "gpu-study", f"PY={sys.executable}", f"CODE_DATA={data}",
                           f"STUDY_OUT={out}", f"STUDY_TRAIN={train}", "STUDY_DEVICE=cpu",
                           "STUDY_EVAL=--device cpu --dtype float32", "STUDY_LENGTHS=16,32,64",
                           "STUDY_SPANS=2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ppl = json.loads((out / "perplexity.json").read_text())["rows"]
    labels = {r["label"] for r in ppl}
    for pos in ("xpos", "rope", "alibi"):
        assert {pos, f"{pos} + BCA", f"{pos} + sliding W=16", f"{pos} + sinks S=4 W=16"} <= labels
    assert {"xpos + yarn", "rope + yarn"} <= labels and {r["length"] for r in ppl} == {16, 32, 64}
    context = json.loads((out / "context.json").read_text())["rows"]
    assert (len(context) == 3 * 4
            and all(r["length"] == 16 * 16 and r["spans"] == 2 for r in context))
    sweep = json.loads((out / "repeat_sweep.json").read_text())["rows"]
    assert {r["kind"] for r in sweep} == {"sweep"} and len({r["ckpt"] for r in sweep}) == 3
    assert max(r["d"] for r in sweep) == 2 * 8 + 4  # (n_layer + 1.5) x H
    log = (out / "log.txt").read_text()
    assert "context probe" in log and "where the rule acts" in log and "perplexity" in log
    # a step that fails stops the target, though its output goes through tee
    failed = subprocess.run(["make", "gpu-study", f"PY={sys.executable}", f"CODE_DATA={data}",
                             f"STUDY_OUT={out}", "STUDY_TRAIN=--n_layer=0", "STUDY_DEVICE=cpu"],
                            cwd=ROOT,
                            capture_output=True, text=True)
    assert failed.returncode != 0 and "n_layer" in failed.stdout + failed.stderr
    assert "eval_extrapolate.py" not in failed.stdout


def test_gpu_study_without_the_corpus_is_one_line(tmp_path):
    done = subprocess.run(["make", "gpu-study", f"PY={sys.executable}",
                           f"CODE_DATA={tmp_path / 'none'}"], cwd=ROOT,
                          capture_output=True, text=True)
    assert (done.returncode != 0
            and f"gpu-study: no {tmp_path / 'none'}; run make code-data first" in done.stdout)


def test_gpu_study_without_cuda_writes_nothing(tmp_path):
    """Issue 45 item 9: without CUDA, make gpu-study truncated the last run's log.txt before
    failing; the device is checked before anything is written."""
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    (data / "meta.json").write_text("{}")
    out.mkdir()
    (out / "log.txt").write_text("the last run's log\n")
    done = subprocess.run(["make", "gpu-study", f"PY={sys.executable}", f"CODE_DATA={data}",
                           f"STUDY_OUT={out}"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode != 0 and "gpu-study: no CUDA device" in done.stderr
    assert (out / "log.txt").read_text() == "the last run's log\n"
    assert sorted(p.name for p in out.iterdir()) == ["log.txt"]


@pytest.mark.parametrize("target", ["gpu-check", "gpu-bench", "gpu-retrieval", "gpu-study"])
def test_gpu_targets_without_their_python_are_one_line(tmp_path, target):
    """Issue 45 item 24: make gpu-check without PY= said '.venv/bin/python: No such file or
    directory'."""
    done = subprocess.run(["make", target, f"PY={tmp_path / 'nopython'}"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert (f"{target}: no Python at {tmp_path / 'nopython'}: run make .venv/installed first, "
            "or give PY=python3") in done.stdout
