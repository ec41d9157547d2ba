"""Tests for bench.py: every section runs end to end at a tiny scale and reports what it measured.
No timing is asserted here (speed is measured by bench.py itself, never in tests)."""

import json

import pytest

import bench
from test_train import words_dataset

TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=11)


@pytest.fixture
def tiny_bench(monkeypatch):
    monkeypatch.setattr(bench, "TRAIN_SHAPE", TINY | dict(bias=False))
    monkeypatch.setattr(bench, "LENGTH_SHAPE", TINY | dict(pos="xpos"))
    monkeypatch.setattr(bench, "DTYPE_SHAPE", TINY | dict(pos="xpos"))
    monkeypatch.setattr(bench, "LENGTH_MULTS", (2, 4, 32, 64))  # what the summary ratios need
    monkeypatch.setattr(bench, "LENGTH_PASSES", 1)
    monkeypatch.setattr(bench, "DATA_MB", 0.2)


@pytest.mark.slow
def test_every_section_reports_its_rows(tiny_bench, tmp_path, capsys):
    out = tmp_path / "b.json"
    bench.main(["--device", "cpu", "--rounds", "1", "--plain_max_mult", "2", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    train = [r for r in rows if r["section"] == "train"]
    assert [r["pos"] for r in train] == ["learned", "sinusoidal", "rope", "alibi", "xpos", "none"]
    assert all(r["ms_per_iter"] > 0 and r["device"] == "cpu" and r["dtype"] == "float32"
               for r in train)
    # tokens/s and MFU follow from the time: 16 sequences of block_size tokens per step
    for r in train:
        assert r["tokens_per_s"] == pytest.approx(16 * 8 / (r["ms_per_iter"] / 1e3))
        assert r["mfu"] > 0
    assert ({r["measure"] for r in rows if r["section"] == "overhead"}
            == {"training step", "forward pass"})
    length = [(r["mode"], r["blocks"]) for r in rows if r["section"] == "length"]
    # skipped past --plain_max_mult
    assert ("plain causal", 2) in length and ("plain causal", 4) not in length
    assert {m for m, _ in length} == {"BCA, one piece", "BCA, streamed", "sliding, one piece",
                                      "sinks, one piece", "plain causal"}
    summary = next(r for r in rows if r["section"] == "length_summary")
    assert all(summary[f"{m}_time_32x_over_2x"] > 0
               for m in ("bca", "streamed", "sliding", "sinks"))
    assert [r["context"] for r in rows if r["section"] == "decode"] == [8, 64, 256]
    assert {r["dtype"] for r in rows if r["section"] == "dtype"} == {"float32", "bfloat16"}
    prepared = [r for r in rows if r["section"] == "data"]
    # the same corpus each time
    assert prepared[0]["workers"] == 1 and len({r["tokens"] for r in prepared}) == 1
    assert all(r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
               and r["peak_pss_mib"] > 0
               for r in prepared)
    printed = capsys.readouterr().out
    assert "| pos | ms_per_iter | tokens_per_s | mfu |" in printed and f"wrote {out}" in printed


@pytest.mark.slow
def test_gpu_section_runs_its_rows_at_a_tiny_scale(monkeypatch, capsys):
    """The GPU section's code path on CPU, at a tiny shape (on a CPU the command
    refuses it, see below)."""
    monkeypatch.setattr(bench, "GPT2_SHAPE", TINY | dict(bias=False))
    monkeypatch.setattr(bench, "PAPER_SHAPE", TINY | dict(pos="xpos"))
    monkeypatch.setattr(bench, "RULE_LENGTHS", (32,))
    rows = bench.bench_gpu("cpu", rounds=1)
    assert [r["T"] for r in rows if r["section"] == "gpu_rules"] == [32]
    steps = [(r["pos"], r["dtype"]) for r in rows if r["section"] == "gpu_train"]
    assert steps == [("learned", "bfloat16"), ("xpos", "bfloat16"), ("xpos", "float16"),
                     ("xpos", "bfloat16")]
    summary = rows[-1]
    assert summary["xpos_over_learned"] > 0 and summary["float16_over_bfloat16"] > 0
    assert "xpos/learned" in capsys.readouterr().out


def test_gpu_section_needs_cuda():
    with pytest.raises(SystemExit) as e:
        bench.main(["--only", "gpu", "--device", "cpu"])
    assert e.value.code == "bench.py: error: --only gpu needs a CUDA device, got --device cpu"


def test_bad_section_is_one_line():
    with pytest.raises(SystemExit) as e:
        bench.main(["--only", "train,speed"])
    assert "unknown section 'speed'" in str(e.value.code)


@pytest.mark.slow
def test_loss_check_trains_both_precisions(tiny_bench, tmp_path, capsys):
    data = words_dataset(tmp_path)
    rows = bench.main(["--loss_check", "--iters", "2", "--data_dir", str(data),
                       "--json", str(tmp_path / "l.json")])
    assert [(r["dtype"], r["iters"]) for r in rows] == [("float32", 2), ("bfloat16", 2)]
    assert (rows[1]["val_loss_vs_float32"]
            == pytest.approx(rows[1]["val_loss"] / rows[0]["val_loss"] - 1))
    assert "val_loss_vs_float32" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        bench.main(["--loss_check", "--data_dir", str(tmp_path / "none")])
    assert "is not prepared" in str(e.value.code)


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--rounds", "-2"],
                                  ["--loss_check", "--iters", "0"]])
def test_no_rounds_or_no_iterations_is_one_line(argv, tmp_path):
    with pytest.raises(SystemExit) as e:
        bench.main([*argv, "--data_dir", str(tmp_path), "--json", str(tmp_path / "b.json")])
    assert e.value.code == f"bench.py: error: {argv[-2]} {argv[-1]} is not allowed: must be >= 1"
