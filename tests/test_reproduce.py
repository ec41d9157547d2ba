"""Tests for reproduce.py: the whole study on a toy budget (two schemes, so that it takes a minute or two), its
resumability, the spread over seeds by hand, and its errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import reproduce

ROOT = Path(__file__).resolve().parent.parent


def study(tmp, *extra):
    argv = [sys.executable, "reproduce.py", "--budget", "toy", "--schemes", "learned,rope", "--results",
            str(tmp / "results"), "--runs", str(tmp / "runs"), "--data", str(tmp / "data"), *extra]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def toy_study(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("study")
    done = study(tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp, done.stdout


def test_toy_study_end_to_end(toy_study):
    tmp, stdout = toy_study
    results = tmp / "results"
    summary = json.loads((results / "summary.json").read_text())
    ppl = summary["perplexity"]
    # rope: 3 seeds at every length 4 .. 64 (l = 16), under each window rule and each interpolation
    for name in ("rope", "rope + BCA", "rope + sliding W=16", "rope + sinks S=4 W=16", "rope + pi", "rope + yarn",
                 "rope + dynamic_ntk", "rope + ntk"):
        assert sorted(ppl[name]) == ["16", "32", "4", "64"] and all(c["n"] == 3 for c in ppl[name].values())
    # learned positions stop at block_size: measured up to l only, with one seed
    assert sorted(ppl["learned"]) == ["16", "4"] and ppl["learned"]["16"]["n"] == 1
    assert summary["resolution"]["rope + BCA"]["R at 2l"]["n"] == 3
    assert "R at 2l" not in summary["resolution"]["learned"]
    assert summary["effective_context"]["rope + BCA"]["reach bound"]["mean"] == 2 * 16 / 2  # n_layer * l / 2
    assert set(summary["passkey_accuracy"]) == {"rope", "rope + BCA", "rope + sliding W=16", "rope + sinks S=4 W=16"}
    for name in ("tables.md", "perplexity.png", "figure2_theory.png", "passkey_rope.png", "timings.json"):
        assert (results / name).stat().st_size > 0
    tables = (results / "tables.md").read_text()
    mean, std = ppl["rope + BCA"]["64"]["mean"], ppl["rope + BCA"]["64"]["std"]
    assert f"{mean:.2f} ± {std:.2f}" in tables
    assert "about" in stdout and "left)" in stdout  # progress with the time left


def test_spread_against_the_seeds_rows(toy_study):
    """The table's mean and std are those of the three seeds' own rows in eval_extrapolate.py's JSON."""
    tmp, _ = toy_study
    rows = json.loads((tmp / "results" / "raw" / "rope.ppl.json").read_text())["rows"]
    values = [r["ppl"] for r in rows if r["length"] == 32 and r["attention"] == "sinks"]
    assert len(values) == 3 and len({r["ckpt"] for r in rows}) == 3
    mean = sum(values) / 3
    std = (sum((v - mean) ** 2 for v in values) / 2) ** 0.5
    cell = json.loads((tmp / "results" / "summary.json").read_text())["perplexity"]["rope + sinks S=4 W=16"]["32"]
    assert cell["mean"] == pytest.approx(mean) and cell["std"] == pytest.approx(std)


def test_resumes_only_what_is_missing(toy_study):
    tmp, _ = toy_study
    raw = tmp / "results" / "raw"
    kept = (raw / "rope.ppl.json").stat().st_mtime_ns
    (raw / "learned.repeat.json").unlink()
    again = study(tmp)
    assert again.returncode == 0, again.stderr
    lines = again.stdout.splitlines()
    ran = [line for line in lines if line.startswith("[")]
    assert len(ran) == 2 and "repeat probe learned" in ran[0] and "tables and plots" in ran[1]
    assert (raw / "learned.repeat.json").exists() and (raw / "rope.ppl.json").stat().st_mtime_ns == kept


def test_spread():
    assert reproduce.spread([1.0, 2.0, 4.0]) == {"mean": pytest.approx(7 / 3), "std": pytest.approx(1.5275252),
                                                 "n": 3}
    assert reproduce.spread([2.0]) == {"mean": 2.0, "std": None, "n": 1}
    assert reproduce.spread([None, 3.0]) == {"mean": 3.0, "std": None, "n": 1} and reproduce.spread([None]) is None


@pytest.mark.parametrize("argv, message", [
    (["--schemes", "rope,posfree"], "--schemes rope,posfree: unknown posfree; the study's schemes are learned"),
    (["--budget", "huge"], "invalid choice: 'huge'"),
])
def test_errors(tmp_path, argv, message):
    done = study(tmp_path, *argv)
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr


def test_a_failed_job_stops_with_one_line_and_keeps_the_rest(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text("{}")  # a dataset that train.py refuses
    done = study(tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("reproduce.py: error: train learned_s1337 failed (exit 1)")
    assert (tmp_path / "data" / "meta.json").read_text() == "{}"
