"""Tests for eval_extrapolate.py: each protocol's token counts and NLL sums by hand, BCA
modes, JSON, errors."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import eval_extrapolate
import prepare_data
from conftest import CHARS, make_checkpoint
from lexgpt.checkpoint import save_checkpoint
from model import AttentionRule, RopeScaling

ROOT = Path(__file__).resolve().parent.parent
STREAM_LENGTH = 75  # 40 + 25 + 10 validation tokens


def run(*argv):
    return eval_extrapolate.main([str(a) for a in argv])


def stream(data_dir):
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    return torch.from_numpy(np.fromfile(Path(data_dir) / meta["files"]["val"]["file"],
                                        np.uint16).astype(np.int64))


def nll_of(model, tokens, first_scored=0, attention="causal", rope_scaling=None):
    """Reference: summed NLL of predicting tokens[1:] from tokens[:-1], scoring
    positions >= first_scored."""
    with torch.no_grad():
        logits, _ = model(tokens[None, :-1], tokens[None, 1:], attention=attention,
                          rope_scaling=rope_scaling)
    nll = F.cross_entropy(logits[0].double(), tokens[1:], reduction="none")
    return nll[first_scored:].sum().item(), len(tokens) - 1 - first_scored


def test_lex_uniform_model_scores_ln_vocab(tiny_data, tmp_path):
    make_checkpoint(tmp_path / "u.pt", tiny_data, zero=True)
    rows = run("--ckpt", tmp_path / "u.pt", "--lengths", "4,5,16", "--max_len", 16, "--bca", "off")
    # documents of 40 and 25 tokens have max_len + 1 = 17 tokens; the one of 10 is skipped
    # every length scores the same 2 x 16 tokens (5: 5+5+5+1)
    assert [r["tokens"] for r in rows] == [32, 32, 32]
    for r in rows:
        assert (r["nll"] == pytest.approx(math.log(len(CHARS)), abs=1e-6)
                and r["ppl"] == pytest.approx(len(CHARS)))


def test_lex_nll_by_hand(tiny_data, tmp_path):
    model = make_checkpoint(tmp_path / "m.pt", tiny_data)
    s = stream(tiny_data)
    rows = run("--ckpt", tmp_path / "m.pt", "--lengths", "4,8,16", "--max_len", 16, "--bca", "off")
    for r in rows:
        L, total, count = r["length"], 0.0, 0
        for doc_start in (0, 40):  # the two long documents, first 16 predicted tokens each
            for i in range(0, 16, L):
                n, c = nll_of(model, s[doc_start + i : doc_start + i + L + 1])
                total, count = total + n, count + c
        assert r["tokens"] == count == 32 and r["nll"] == pytest.approx(total / count, rel=1e-6)


def test_lex_every_span_by_hand(tiny_data, tmp_path):
    model = make_checkpoint(tmp_path / "m.pt", tiny_data)
    s = stream(tiny_data)
    # documents of 40, 25 and 10 tokens; spans of max_len + 1 = 9 tokens every 8: 4 in the first
    # (starts 0 .. 24, as 32 + 9 > 40), 3 in the second (40, 48, 56), 1 in the third (65); K = 3
    # takes the 0th, 8//3-th, 16//3-th
    every = [0, 8, 16, 24, 40, 48, 56, 65]
    for spans, starts in (("all", every), ("3", [0, 16, 48]), ("first", [0, 40, 65])):
        rows = run("--ckpt", tmp_path / "m.pt", "--lengths", "4,8", "--max_len", 8, "--bca", "off",
                   "--spans", spans)
        for r in rows:
            parts = [nll_of(model, s[a + i : a + i + r["length"] + 1]) for a in starts
                     for i in range(0, 8, r["length"])]
            assert r["tokens"] == 8 * len(starts) == sum(c for _, c in parts)
            assert r["nll"] == pytest.approx(sum(n for n, _ in parts) / r["tokens"], rel=1e-6)


@pytest.mark.parametrize("argv, message", [
    (("--spans", "9"), "--spans 9: the validation text has only 8 whole spans"),
    (("--spans", "0"), "--spans '0' is not allowed: first, all, or a whole number >= 1"),
    (("--spans", "some"), "--spans 'some' is not allowed"),
    (("--spans", "²"), "--spans '²' is not allowed"),  # str.isdigit() takes it, int() does not
    (("--spans", "all", "--protocol", "chunks"), "--spans all applies to the lex protocol only"),
])
def test_spans_errors(tiny_data, tmp_path, capsys, argv, message):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", "--lengths", "4,8", "--max_len", 8, *argv)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_one_file_named_by_two_output_flags_is_refused(tiny_data, tmp_path):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", "--lengths", "4,8", "--plot", tmp_path / "x.png",
            "--plot_positions", tmp_path / "x.png")
    assert ("--json, --plot and --plot_positions name the same file" in str(e.value)
            and "\n" not in str(e.value))
    assert not (tmp_path / "x.png").exists()


def test_chunks_by_hand(tiny_data, tmp_path):
    model = make_checkpoint(tmp_path / "m.pt", tiny_data)
    s = stream(tiny_data)
    rows = run("--ckpt", tmp_path / "m.pt", "--lengths", "8,16", "--protocol", "chunks",
               "--bca", "off")
    for r in rows:
        L = r["length"]
        n_chunks = (STREAM_LENGTH - 1) // L  # 9 chunks of 8, 4 chunks of 16
        parts = [nll_of(model, s[i * L : i * L + L + 1]) for i in range(n_chunks)]
        assert r["tokens"] == n_chunks * L == sum(c for _, c in parts)
        assert r["nll"] == pytest.approx(sum(n for n, _ in parts) / r["tokens"], rel=1e-6)


def test_sliding_by_hand(tiny_data, tmp_path):
    model = make_checkpoint(tmp_path / "m.pt", tiny_data)
    s = stream(tiny_data)
    out = tmp_path / "sliding.json"
    run("--ckpt", tmp_path / "m.pt", "--lengths", "8", "--protocol", "sliding", "--stride", 3,
        "--bca", "off", "--json", out)
    row = json.loads(out.read_text())["rows"][0]
    # windows start at 0, 3, 6, ...; the first scores its 8 targets, each later one its
    # last 3 (the last fewer)
    total, count, done = 0.0, 0, 0  # done: targets s[1 .. done] already scored
    for begin in range(0, STREAM_LENGTH - 1, 3):
        end = min(begin + 8, STREAM_LENGTH - 1)
        n, c = nll_of(model, s[begin : end + 1], first_scored=max(0, done - begin))
        total, count, done = total + n, count + c, end
        if end == STREAM_LENGTH - 1:
            break
    assert row["tokens"] == count == STREAM_LENGTH - 1  # every token scored exactly once
    assert row["nll"] == pytest.approx(total / count, rel=1e-6)


def test_bca_both_json_and_plot(tiny_data, tmp_path):
    model = make_checkpoint(tmp_path / "m.pt", tiny_data, block_size=8)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    run("--ckpt", tmp_path / "m.pt", "--lengths", "4,8,32", "--max_len", 32, "--bca", "both",
        "--json", out, "--plot", png)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["bca"], r["length"]) for r in rows] == [(False, 4), (False, 8), (False, 32),
                                                       (True, 4), (True, 8),
                                                      (True, 32)]
    assert set(rows[0]) == {"ckpt", "pos", "bca", "attention", "window", "sinks", "rope_scaling",
                            "rope_factor", "rope_original_length", "yarn_alpha", "yarn_beta",
                            "length", "ppl", "nll", "tokens", "label"}
    assert [(r["attention"], r["window"], r["label"])
            for r in rows[2:4]] == [("causal", None, "xpos"),
                                    ("bca", 8, "xpos + BCA")]
    by = {(r["bca"], r["length"]): r["nll"] for r in rows}
    # within block_size BCA changes nothing
    assert by[(False, 4)] == pytest.approx(by[(True, 4)], abs=1e-6)
    assert by[(False, 8)] == pytest.approx(by[(True, 8)], abs=1e-6)
    assert by[(False, 32)] != pytest.approx(by[(True, 32)], abs=1e-6)
    n, c = nll_of(model, stream(tiny_data)[:33], attention="bca")
    assert by[(True, 32)] == pytest.approx(n / c, rel=1e-6)
    curves = result["curves"]
    assert len(curves) == 6 and [len(c["mean_nll"]) for c in curves] == [4, 8, 32] * 2
    assert png.stat().st_size > 1000


def test_markdown_table_marks_rises():
    rows = [dict(label="xpos", length=n, ppl=p) for n, p in ((1, 5.0), (2, 4.0), (4, 4.5))]
    table = eval_extrapolate.markdown_table(rows, [1, 2, 4]).splitlines()
    assert table[0] == "| model | 1 | 2 | 4 |" and table[2] == "| xpos | 5.000 | 4.000 | 4.500 ↑ |"


@pytest.mark.slow
def test_torchrun_matches_single_process(tiny_data, tmp_path):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    args = ["--ckpt", str(tmp_path / "m.pt"), "--lengths", "4,8,16", "--max_len", "16",
            "--bca", "both"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "eval_extrapolate.py", *args, "--json", str(tmp_path / "ddp.json")]
    result = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    single = run(*args)
    ddp = json.loads((tmp_path / "ddp.json").read_text())["rows"]
    assert [r["tokens"] for r in ddp] == [r["tokens"] for r in single]
    assert max(abs(a["nll"] - b["nll"]) for a, b in zip(ddp, single)) < 1e-9


@pytest.mark.parametrize("argv,message", [
    (["--lengths", "4,eight"], "must be comma-separated integers"),
    (["--lengths", "4,32", "--max_len", "16"], "length 32 is above --max_len 16"),
    (["--lengths", "40"], "no validation document has max_len+1 = 41 tokens (the longest has 40)"),
    (["--lengths", "8", "--protocol", "sliding", "--stride", "9"],
     "--stride 9 is longer than length 8"),
])
def test_errors(tiny_data, tmp_path, argv, message):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", *argv)
    assert message in str(e.value.code)


def test_checkpoint_errors(tiny_data, tmp_path):
    make_checkpoint(tmp_path / "learned.pt", tiny_data, pos="learned", block_size=8)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "learned.pt", "--lengths", "8,16")
    assert "cannot go past block_size=8 (asked for 16 positions)" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "missing.pt", "--lengths", "8")
    assert "no checkpoint at" in str(e.value.code)
    (tmp_path / "corrupt.pt").write_bytes(b"\x00" * 100)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "corrupt.pt", "--lengths", "8")
    assert "unreadable (truncated or corrupt?)" in str(e.value.code)


@pytest.mark.parametrize("argv,message", [
    (["--lengths", "8", "--max_len", "0"], "--max_len 0 is not allowed: must be >= 1"),
    (["--lengths", "8", "--batch_tokens", "0"], "--batch_tokens 0 is not allowed"),
    (["--lengths", "8", "--batch_tokens", "-5"], "--batch_tokens -5 is not allowed"),
    (["--lengths", "75", "--protocol", "sliding"], "length 75 needs 76 validation tokens, but"),
    (["--lengths", "80", "--protocol", "chunks"], "length 80 needs 81 validation tokens, but"),
    (["--lengths", "8", "--device", "bogus"], "device='bogus' is not allowed"),
])
def test_bad_values_are_one_line_errors(tiny_data, tmp_path, argv, message):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", *argv)
    assert message in str(e.value.code)


def test_output_paths_are_checked_first(tiny_data, tmp_path, monkeypatch, capsys):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    monkeypatch.setattr(eval_extrapolate, "score", None)  # any scoring would fail with a TypeError
    for flag in ("--json", "--plot"):
        with pytest.raises(SystemExit) as e:
            run("--ckpt", tmp_path / "m.pt", "--lengths", "8", flag, tmp_path)
        assert f"{flag} {tmp_path} is a directory" in str(e.value.code)
    monkeypatch.undo()
    run("--ckpt", tmp_path / "m.pt", "--lengths", "8", "--plot", tmp_path / "curve")
    assert (f"wrote {tmp_path / 'curve.png'}" in capsys.readouterr().out
            and (tmp_path / "curve.png").is_file())


def test_every_checkpoint_is_checked_before_any_is_scored(tiny_data, tmp_path, monkeypatch):
    make_checkpoint(tmp_path / "good.pt", tiny_data)
    make_checkpoint(tmp_path / "learned.pt", tiny_data, pos="learned", block_size=8)
    monkeypatch.setattr(eval_extrapolate, "score", None)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "good.pt", "--ckpt", tmp_path / "learned.pt", "--lengths", "8,16")
    assert "learned.pt: pos='learned' cannot go past block_size=8" in str(e.value.code)


def test_dataset_with_another_tokenizer_is_refused(tiny_data, tmp_path):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    (tmp_path / "c").mkdir()
    # 16 characters against the model's 11
    (tmp_path / "c" / "a.txt").write_text("0123456789abcdef" * 20)
    prepare_data.main(["--dataset", "files", "--path", str(tmp_path / "c"),
                       "--out_dir", str(tmp_path / "d")])
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", "--lengths", "8", "--data_dir", tmp_path / "d")
    assert "vocab_size 11" in str(e.value.code) and "vocab_size 16" in str(e.value.code)


def test_non_finite_nll_is_an_error(tiny_data, tmp_path):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    ckpt = torch.load(tmp_path / "m.pt", weights_only=True)
    ckpt["model"]["transformer.ln_f.weight"][0] = float("inf")
    # a checkpoint edited by hand is saved with fresh checksums
    save_checkpoint(ckpt, tmp_path / "inf.pt")
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "inf.pt", "--lengths", "4,8", "--max_len", 8)
    assert (f"non-finite NLL (nan) for {tmp_path / 'inf.pt'} at length 4 in float32"
            in str(e.value.code))
    assert "the checkpoint's weights hold inf or NaN (transformer.ln_f.weight)" in str(e.value.code)
    with pytest.raises(SystemExit) as e:  # the weights are the cause in any dtype
        run("--ckpt", tmp_path / "inf.pt", "--lengths", "4,8", "--max_len", 8,
            "--dtype", "bfloat16")
    assert ("in bfloat16" in str(e.value.code)
            and "weights hold inf or NaN (transformer.ln_f.weight)" in str(e.value.code))


def test_rows_scored_before_a_non_finite_one_are_kept_and_the_cause_named(tiny_data, tmp_path,
                                                                          monkeypatch, capsys):
    """Finite weights, a non-finite score at the second length (an activation past bfloat16's range,
    say): the first length's row is printed and written to --json, and the error names the
    dtype, not the weights."""
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    real = eval_extrapolate.score

    def overflow_at_8(model, stream, pieces, length, *a):
        sums = real(model, stream, pieces, length, *a)
        return sums * float("nan") if length == 8 else sums
    monkeypatch.setattr(eval_extrapolate, "score", overflow_at_8)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", "--lengths", "4,8", "--max_len", 8, "--dtype", "bfloat16",
            "--json", tmp_path / "r.json")
    message = str(e.value.code)
    assert ("at length 8 in bfloat16" in message
            and "an activation passed bfloat16's range" in message)
    assert f"the 1 rows scored before it are printed above and in {tmp_path / 'r.json'}" in message
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["length"] for r in rows] == [4] and math.isfinite(rows[0]["ppl"])
    # and the table was printed
    assert "perplexity (lex protocol, bfloat16" in capsys.readouterr().out


def test_logits_in_chunks_give_the_same_numbers(tiny_data, tmp_path):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    argv = ["--ckpt", tmp_path / "m.pt", "--lengths", "4,32", "--max_len", 32, "--bca", "both"]
    # 32-token pieces: 11 chunks of logits
    whole, chunked = run(*argv), run(*argv, "--batch_tokens", 3)
    assert [r["tokens"] for r in whole] == [r["tokens"] for r in chunked]
    for a, b in zip(whole, chunked):
        assert a["nll"] == pytest.approx(b["nll"], rel=1e-6)


@pytest.mark.parametrize("method", ["pi", "yarn"])
def test_a_checkpoint_with_a_scaling_is_evaluated_under_it_unless_told(tiny_data, tmp_path, method):
    """A fine-tuned checkpoint's scaling (GPTConfig.rope_scaling: s = 2 from an original length of
    8, at block_size 64) is every row's with no flag: its NLL is the same weights' under that
    scaling passed in (YaRN's ramp over 8, not 64); --rope_scaling none scores the plain angles."""
    scaled = make_checkpoint(tmp_path / "s.pt", tiny_data, pos="rope", block_size=64,
                             rope_scaling=method, rope_factor=2.0, rope_original_length=8)
    plain = make_checkpoint(tmp_path / "plain.pt", tiny_data, pos="rope", block_size=64)
    assert all(torch.equal(a, b) for a, b in zip(scaled.state_dict().values(),
                                                 plain.state_dict().values()))
    for argv, scaling in (((), RopeScaling(method, 2.0, 8)), (("--rope_scaling", "none"), None)):
        rows = run("--ckpt", tmp_path / "s.pt", "--lengths", 16, "--max_len", 16,
                   "--bca", "off", *argv)
        by_doc = [nll_of(plain, stream(tiny_data)[start : start + 17], rope_scaling=scaling)
                  for start in (0, 40)]
        first = rows[0]
        assert first["nll"] == pytest.approx(sum(n for n, _ in by_doc) / sum(c for _, c in by_doc),
                                             rel=1e-6)
        assert (first["rope_scaling"],
                first["rope_factor"]) == ((method, 2.0) if scaling else ("none", None))
        assert first["label"] == (f"rope + {method} s=2 from 8" if scaling else "rope")
    if method == "yarn":  # the original length matters: over block_size the numbers differ
        over_64, _ = nll_of(plain, stream(tiny_data)[:17], rope_scaling=RopeScaling("yarn", 2.0))
        over_8, _ = nll_of(plain, stream(tiny_data)[:17], rope_scaling=RopeScaling("yarn", 2.0, 8))
        assert abs(over_64 - over_8) > 1e-6


def yarn_fine_tune(tmp_path, data_dir):
    """A YaRN fine-tune as train.py --init_from writes it (s = 2 from an original length of 8, at
    block_size 64), and the same weights with no scaling."""
    make_checkpoint(tmp_path / "s.pt", data_dir, pos="rope", block_size=64, rope_scaling="yarn",
                    rope_factor=2.0, rope_original_length=8)
    return make_checkpoint(tmp_path / "plain.pt", data_dir, pos="rope", block_size=64)


def test_an_explicit_scaling_on_a_fine_tune_counts_from_its_original_length(tiny_data, tmp_path):
    """--rope_scaling and --rope_factor on a checkpoint that stores an original length use it, as
    its own scaling does: its own method and factor given explicitly give the default's rows, and
    another factor is YaRN's ramp over 8, not block_size. Every row records the original length
    it used, so the JSON tells the two apart."""
    plain = yarn_fine_tune(tmp_path, tiny_data)
    common = ("--lengths", 16, "--max_len", 16, "--bca", "off")
    own = run("--ckpt", tmp_path / "s.pt", *common)
    explicit = run("--ckpt", tmp_path / "s.pt", *common, "--rope_scaling", "yarn",
                   "--rope_factor", 2)
    assert explicit == own and own[0]["rope_original_length"] == 8
    out = tmp_path / "r.json"
    rows = run("--ckpt", tmp_path / "s.pt", *common, "--rope_scaling", "none,pi,yarn",
               "--rope_factor", 3, "--json", out)
    for row, scaling in zip(rows, (None, RopeScaling("pi", 3.0), RopeScaling("yarn", 3.0, 8))):
        by_doc = [nll_of(plain, stream(tiny_data)[start : start + 17], rope_scaling=scaling)
                  for start in (0, 40)]
        assert row["nll"] == pytest.approx(sum(n for n, _ in by_doc) / sum(c for _, c in by_doc),
                                           rel=1e-6)
        assert row["rope_original_length"] == (scaling and 8)
    written = json.loads(out.read_text())
    assert [r["rope_original_length"] for r in written["rows"]] == [None, 8, 8]
    assert [c["rope_original_length"] for c in written["curves"]] == [None, 8, 8]
    # a model never fine-tuned counts from its block_size
    base = run("--ckpt", tmp_path / "plain.pt", *common, "--rope_scaling", "yarn",
               "--rope_factor", 2)
    assert base[0]["rope_original_length"] == 64


def test_yarn_without_a_factor_on_a_fine_tune_is_dynamic(tiny_data, tmp_path, capsys):
    """Without --rope_factor, s follows the length from the original length, YaRN's dynamic rule
    (RopeScaling.factor_at): on a fine-tune at 4 x its original 4 that is its own s = 4 up to its
    block_size and L / 4 past it. Each row is the explicit factor's at its length, recorded with
    rope_factor None."""
    make_checkpoint(tmp_path / "s.pt", tiny_data, pos="rope", block_size=16, rope_scaling="yarn",
                    rope_factor=4.0, rope_original_length=4)
    common = ("--ckpt", tmp_path / "s.pt", "--max_len", 32, "--bca", "off")
    rows = run(*common, "--lengths", "8,32", "--rope_scaling", "yarn")
    assert [(r["length"], r["rope_factor"], r["rope_original_length"], r["label"])
            for r in rows] == [(n, None, 4, "rope + yarn dynamic from 4") for n in (8, 32)]
    own = run(*common, "--lengths", 8)
    at_8 = run(*common, "--lengths", 32, "--rope_scaling", "yarn", "--rope_factor", 8)
    assert [r["nll"] for r in rows] == [own[0]["nll"], at_8[0]["nll"]]


def test_yarn_without_a_factor_is_refused_where_it_is_not_its_own(tiny_data, tmp_path,
                                                                   monkeypatch):
    """A fine-tune whose s is not block_size / l (s = 2 from 8 at 64): the dynamic rule would not
    give it its own angles at its own length; one line before any work, never an empty table."""
    yarn_fine_tune(tmp_path, tiny_data)
    monkeypatch.setattr(eval_extrapolate, "score", None)  # refused before any scoring
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "s.pt", "--lengths", 16, "--max_len", 16, "--bca", "off",
            "--rope_scaling", "yarn")
    message = str(e.value.code)
    assert len(message.splitlines()) == 1 and "nothing to score" in message
    assert ("yarn without --rope_factor takes s = max(L, block_size) / 8, 8 up to block_size "
            "(64), not the yarn s=2 from 8 this checkpoint was trained with") in message


def test_yarn_ramp_ends_are_flags_and_row_fields(tiny_data, tmp_path):
    """--yarn_alpha and --yarn_beta move YaRN's ramp (the official beta_slow, beta_fast); rows
    record them, and the label names them where they are not the defaults. A fine-tune keeps its
    own unless asked."""
    make_checkpoint(tmp_path / "m.pt", tiny_data, pos="rope", block_size=16)
    common = ("--ckpt", tmp_path / "m.pt", "--lengths", 32, "--max_len", 32, "--bca", "off",
              "--rope_scaling", "yarn", "--rope_factor", 2)
    default = run(*common)[0]
    tuned = run(*common, "--yarn_alpha", 0.25, "--yarn_beta", 2)[0]
    assert (default["yarn_alpha"], default["yarn_beta"], default["label"]) == (1.0, 32.0,
                                                                             "rope + yarn s=2")
    assert (tuned["yarn_alpha"], tuned["yarn_beta"]) == (0.25, 2.0)
    assert tuned["label"] == "rope + yarn s=2 a=0.25 b=2" and tuned["nll"] != default["nll"]
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", "--lengths", 8, "--yarn_alpha", 2)
    assert str(e.value.code).endswith("--yarn_alpha 2 applies to --rope_scaling yarn only")
    with pytest.raises(SystemExit) as e:
        run(*common, "--yarn_alpha", 4, "--yarn_beta", 2)
    assert "yarn_alpha=4.0, yarn_beta=2.0 are not allowed: must be finite numbers" in str(
        e.value.code)


def test_nothing_to_score_is_an_error(tiny_data, tmp_path, monkeypatch):
    """Every combination skipped (an interpolation that is the identity under auto): one line,
    not an empty table with status 0."""
    make_checkpoint(tmp_path / "m.pt", tiny_data, pos="rope")
    monkeypatch.setattr(eval_extrapolate, "score", None)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", "--lengths", 8, "--rope_scaling", "yarn")
    assert ("nothing to score: every combination is skipped: " in str(e.value.code)
            and "yarn is the identity under auto" in str(e.value.code))


def test_one_command_compares_rules_and_interpolations(tiny_data, tmp_path, capsys):
    """Rows are checkpoint x attention x scaling; pointless combinations are skipped and listed;
    each row's NLL is the model's own under that rule, by hand."""
    rope = make_checkpoint(tmp_path / "rope.pt", tiny_data, pos="rope")
    make_checkpoint(tmp_path / "alibi.pt", tiny_data, pos="alibi")
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    run("--ckpt", tmp_path / "rope.pt", "--ckpt", tmp_path / "alibi.pt", "--lengths", "8,32",
        "--max_len", 32, "--attention", "causal,sliding,sinks", "--window", 6, "--sinks", 2,
        "--rope_scaling", "none,yarn", "--json", out, "--plot", png)
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    combos = [(Path(r["ckpt"]).stem, r["attention"], r["rope_scaling"]) for r in result["rows"]
              if r["length"] == 32]
    assert combos == [("rope", "causal", "none"), ("rope", "causal", "yarn"),
                      ("rope", "sliding", "none"), ("rope", "sinks", "none"),
                      ("alibi", "causal", "none"), ("alibi", "sliding", "none"),
                      ("alibi", "sinks", "none")]
    skipped = result["skipped"]
    assert len(skipped) == 5 and all(line in printed for line in skipped)
    assert sum("yarn is the identity under sliding" in line for line in skipped) == 1
    assert sum("yarn rescales rotary angles, and pos=alibi has none" in line
               for line in skipped) == 3
    row = {(Path(r["ckpt"]).stem, r["attention"], r["rope_scaling"], r["length"]): r
           for r in result["rows"]}
    sinks = row["rope", "sinks", "none", 32]
    assert ((sinks["window"], sinks["sinks"], sinks["bca"], sinks["label"])
            == (6, 2, False, "rope + sinks S=2 W=6"))
    assert "| rope + sinks S=2 W=6 |" in printed and "| rope + yarn |" in printed
    tokens = stream(tiny_data)[:33]  # the lex protocol's one 32-token piece (the 40-token document)
    for attention, scaling in ((AttentionRule("sinks", 6, 2), None),
                               (AttentionRule("sliding", 6), None), ("causal", "yarn")):
        n, c = nll_of(rope, tokens, attention=attention, rope_scaling=scaling)
        key = ("rope", getattr(attention, "name", attention), scaling or "none", 32)
        assert row[key]["nll"] == pytest.approx(n / c, rel=1e-6) and row[key]["tokens"] == c
    assert len({r["nll"] for r in result["rows"] if r["length"] == 32
                and r["ckpt"].endswith("rope.pt")}) == 4
    curves = {(Path(c["ckpt"]).stem, c["attention"], c["rope_scaling"], c["length"])
              for c in result["curves"]}
    assert set(row) == curves and png.stat().st_size > 1000


@pytest.mark.parametrize("argv, message", [
    (["--bca", "on", "--attention", "sliding"],
     "--bca on and --attention sliding both given: use --attention"),
    (["--attention", "bca,window"],
     "--attention 'bca,window' is not allowed: must be one of auto, causal, bca"),
    (["--window", 4], "--window 4 applies to --attention sliding or sinks only"),
    (["--attention", "sliding", "--sinks", 2], "--sinks 2 applies to --attention sinks only"),
    (["--attention", "sinks", "--sinks", 8], "sinks=8 is not allowed with window=8"),
    (["--attention", "sliding", "--window", 0],
     "window=0 is not allowed: must be a positive integer"),
    (["--rope_scaling", "linear"],
     "--rope_scaling 'linear' is not allowed: must be one of none, pi, ntk"),
    (["--rope_scaling", "none,dynamic_ntk", "--rope_factor", 2],
     "--rope_factor 2.0 applies to --rope_scaling pi"),
    (["--rope_scaling", "pi", "--rope_factor", -1],
     "rope_factor=-1.0 is not allowed: must be a finite number > 0"),
    (["--rope_scaling", "yarn", "--rope_factor", "inf"],
     "rope_factor=inf is not allowed: must be a finite number"),
    (["--attention", "sinks", "--sinks", 0], "sinks=0 is not allowed: must be a positive integer"),
])
def test_attention_flags_errors(tiny_data, tmp_path, monkeypatch, argv, message):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    monkeypatch.setattr(eval_extrapolate, "score", None)  # checked before any scoring
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", "--lengths", "8,16", *argv)
    assert message in str(e.value.code)


def test_plot_positions(tiny_data, tmp_path, capsys, monkeypatch):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    drawn = []
    real = eval_extrapolate.plot_positions
    monkeypatch.setattr(eval_extrapolate, "plot_positions", lambda *a: drawn.append(a) or real(*a))
    run("--ckpt", tmp_path / "m.pt", "--lengths", "8,32", "--max_len", 32, "--bca", "both",
        "--plot_positions", tmp_path / "pos")
    assert (f"wrote {tmp_path / 'pos.png'}" in capsys.readouterr().out
            and (tmp_path / "pos.png").stat().st_size > 1000)
    rows, curves, block_sizes, _ = drawn[0]
    assert [len(c["mean_nll"]) for c in curves] == [8, 32, 8, 32] and block_sizes == {8}
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", "--lengths", "8", "--plot_positions", tmp_path)
    assert f"--plot_positions {tmp_path} is a directory" in str(e.value.code)


def test_outputs_never_replace_a_file_that_is_not_an_earlier_output(tiny_data, tmp_path,
                                                                    monkeypatch, capsys):
    """--json onto the checkpoint itself used to turn it into JSON, exit 0; an earlier
    output is replaced."""
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    checkpoint = (tmp_path / "m.pt").read_bytes()
    (tmp_path / "mine.png").write_text("not a picture")
    monkeypatch.setattr(eval_extrapolate, "score", None)  # any scoring would fail with a TypeError
    for flag, path, kind in (("--json", "m.pt", "JSON output"), ("--plot", "mine.png", "plot"),
                             ("--plot_positions", "mine.png", "plot")):
        with pytest.raises(SystemExit) as e:
            run("--ckpt", tmp_path / "m.pt", "--lengths", "8", flag, tmp_path / path)
        assert (f"{flag} {tmp_path / path} exists and is not an earlier {kind} of lex-gpt"
                in str(e.value.code))
    assert (tmp_path / "m.pt").read_bytes() == checkpoint
    monkeypatch.undo()
    for _ in range(2):  # the second run replaces the first's outputs
        run("--ckpt", tmp_path / "m.pt", "--lengths", "8", "--json", tmp_path / "r.json",
            "--plot", tmp_path / "r.png")
    assert json.loads((tmp_path / "r.json").read_text())["written_by"] == "lex-gpt"


def test_a_damaged_checkpoint_is_refused_before_scoring(tiny_data, tmp_path, monkeypatch):
    from test_common import damage_record
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    damage_record(tmp_path / "m.pt")
    monkeypatch.setattr(eval_extrapolate, "score", None)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", "--lengths", "8")
    assert "m.pt is damaged: the checksum of its model tensors does not match" in str(e.value.code)

def test_ctrl_c_is_one_line(tiny_data, tmp_path, monkeypatch, capsys):
    """Ctrl-C mid-evaluation printed a KeyboardInterrupt traceback of 46 lines: one line saying that
    nothing was written, exit status 130 (the real signal: tests/hostile.py)."""
    import signal
    make_checkpoint(tmp_path / "m.pt", tiny_data)

    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(eval_extrapolate, "score", interrupted)
    # exit_interrupted ignores a second Ctrl-C: pytest's comes back
    handler = signal.getsignal(signal.SIGINT)
    try:
        run("--ckpt", tmp_path / "m.pt", "--lengths", "8", "--json", tmp_path / "r.json")
    # a KeyboardInterrupt escaping would stop pytest itself
    except BaseException as e:  # noqa: B036
        raised = e
    finally:
        signal.signal(signal.SIGINT, handler)
    assert isinstance(raised, SystemExit) and raised.code == 130
    assert capsys.readouterr().err == ("eval_extrapolate.py: interrupted (Ctrl-C): nothing was "
                                       "written (the table, --json and the plots come once every "
                                       "row is measured); run the command again\n")
    assert not (tmp_path / "r.json").exists()


def steep_xpos_checkpoint(path, data_dir, scale_base=4.0):
    """A block_size-8 xPos checkpoint with scale_base = l/2, the study's ratio (the issue's attack
    used 32 at l = 64)."""
    make_checkpoint(path, data_dir, pos="xpos", block_size=8)
    ckpt = torch.load(path, weights_only=True)
    ckpt["model_args"]["xpos_scale_base"] = scale_base
    save_checkpoint(ckpt, path)


def test_xpos_without_bca_scores_finite_far_past_float32s_range(tmp_path):
    """The issue's command: --bca off at 256 and 512 x block_size, where one factor over the
    sequence would be 3.5^256 and 3.5^512 (float32 holds 3.5^70): both rows finite, and close to
    each other (the same model, more context)."""
    from lexgpt.dataset_writer import write_dataset
    rng = np.random.default_rng(0)
    val, train = (rng.integers(0, len(CHARS), n).astype(np.uint16) for n in (4200, 500))
    write_dataset(tmp_path / "d", {"train": (train, [[0, 500]], ["train"]),
                                   "val": (val, [[0, 4200]], ["v"])},
                  dict(tokenizer="char", vocab_size=len(CHARS), dtype="uint16", chars=CHARS,
                       eot_token=None))
    steep_xpos_checkpoint(tmp_path / "m.pt", tmp_path / "d")
    rows = run("--ckpt", tmp_path / "m.pt", "--bca", "off", "--lengths", "2048,4096",
               "--protocol", "chunks")
    assert ([r["length"] for r in rows] == [2048, 4096]
            and all(math.isfinite(r["ppl"]) for r in rows))
    assert abs(rows[0]["nll"] - rows[1]["nll"]) < 0.05


@pytest.mark.parametrize("script, argv", [
    ("eval_extrapolate.py", ["--lengths", "100000000"]),
    ("resolution.py", ["--length", "100000000"]),
])
@pytest.mark.slow
def test_a_huge_length_is_refused_in_bounded_memory(tiny_data, tmp_path, script, argv):
    """A length far past every document: one line, under an address-space limit of 2.5 GB (the
    learned-positions check built the whole position table first: 6.4 GB at 10^8 tokens, a
    MemoryError; issue 33, finding 19)."""
    import resource
    make_checkpoint(tmp_path / "m.pt", tiny_data, pos="rope")
    def limit():
        return resource.setrlimit(resource.RLIMIT_AS, (2_500_000_000, 2_500_000_000))
    done = subprocess.run([sys.executable, str(ROOT / script), "--ckpt", str(tmp_path / "m.pt"),
                           "--data_dir", str(tiny_data), "--device", "cpu", *argv],
                          capture_output=True, text=True, preexec_fn=limit)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-500:]
    assert "error: no validation" in done.stderr and len(done.stderr.strip().splitlines()) == 1
