"""Tests for sample.py: cached generation past block_size, seeding, prompts from
files, clear errors."""

import pytest

import prepare_data
import sample
from conftest import make_checkpoint
from model import GPT, AttentionRule, RopeScaling


def generate(capsys, *argv):
    sample.main([str(a) for a in argv])
    return capsys.readouterr().out


@pytest.mark.parametrize("pos", ["xpos", "rope", "alibi", "sinusoidal", "none"])
@pytest.mark.parametrize("bca", ["auto", "on", "off"])
def test_generates_far_past_block_size(tiny_data, tmp_path, capsys, pos, bca):
    make_checkpoint(tmp_path / "m.pt", tiny_data, pos=pos, block_size=8)
    out = generate(capsys, "--ckpt", tmp_path / "m.pt", "--start", "abc", "--max_new_tokens", 40,
                   "--bca", bca)
    text = out.split("\n")[0]
    assert text.startswith("abc") and len(text) == 43 and set(text) <= set("abcdefghijk")


def test_seeded_samples_and_file_prompt(tiny_data, tmp_path, capsys):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    argv = ["--ckpt", tmp_path / "m.pt", "--start", "ab", "--max_new_tokens", 30,
            "--num_samples", 2]
    first, again = generate(capsys, *argv, "--seed", 1), generate(capsys, *argv, "--seed", 1)
    other = generate(capsys, *argv, "--seed", 2)
    assert first == again and first != other
    samples = first.split("-" * 40)
    assert len(samples) == 2 and samples[0].strip() != samples[1].strip()
    (tmp_path / "prompt.txt").write_text("kkk")
    out = generate(capsys, "--ckpt", tmp_path / "m.pt",
                   "--start", f"FILE:{tmp_path / 'prompt.txt'}", "--max_new_tokens", 5)
    assert out.startswith("kkk") and len(out.split("\n")[0]) == 8


def test_errors(tiny_data, tmp_path):
    make_checkpoint(tmp_path / "learned.pt", tiny_data, pos="learned", block_size=8)
    # 8 positions
    sample.main(["--ckpt", str(tmp_path / "learned.pt"), "--start", "abc", "--max_new_tokens", "6"])
    for argv, message in (
        (["--ckpt", str(tmp_path / "learned.pt"), "--start", "abc", "--max_new_tokens", "7"],
         "cannot go past block_size=8 (asked for 9 positions): "
         "learned absolute positions cannot extrapolate"),
        (["--ckpt", str(tmp_path / "learned.pt"), "--temperature", "0"],
         "--temperature 0.0 must be > 0"),
        (["--ckpt", str(tmp_path / "learned.pt"), "--start", "xyz"], "not in this char vocabulary"),
        (["--ckpt", str(tmp_path / "learned.pt"), "--start", "FILE:/no/such/file"],
         "does not exist"),
        (["--ckpt", str(tmp_path / "missing.pt")], "no checkpoint at"),
    ):
        with pytest.raises(SystemExit) as e:
            sample.main(argv)
        assert message in str(e.value.code)


def test_bad_inputs(tiny_data, tmp_path):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    (tmp_path / "prompt.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("ABCDEFGHIJKLMNOP" * 20)
    prepare_data.main(["--dataset", "files", "--path", str(tmp_path / "c"),
                       "--out_dir", str(tmp_path / "d")])
    for argv, message in (
        (["--start", f"FILE:{tmp_path / 'prompt.bin'}"], "is not UTF-8 text (byte 0)"),
        (["--start", f"FILE:{tmp_path}"], "is a directory"),
        (["--device", "bogus"], "device='bogus' is not allowed"),
        # a 16-character dataset, an 11-character model
        (["--data_dir", str(tmp_path / "d")], "vocab_size 11"),
    ):
        with pytest.raises(SystemExit) as e:
            sample.main(["--ckpt", str(tmp_path / "m.pt"), *argv])
        assert message in str(e.value.code)


@pytest.mark.parametrize("argv, attention, rope_scaling", [
    (["--attention", "sliding", "--window", 5], AttentionRule("sliding", 5), RopeScaling()),
    (["--attention", "sinks", "--sinks", 2], AttentionRule("sinks", sinks=2), RopeScaling()),
    (["--rope_scaling", "yarn", "--attention", "causal"], AttentionRule("causal"),
     RopeScaling("yarn")),
    (["--rope_scaling", "pi", "--rope_factor", 3, "--attention", "causal"], AttentionRule("causal"),
     RopeScaling("pi", 3.0)),
    (["--rope_scaling", "dynamic_ntk", "--attention", "causal"], AttentionRule("causal"),
     RopeScaling("dynamic_ntk"))])
def test_generates_with_windows_and_interpolation(tiny_data, tmp_path, capsys, monkeypatch, argv,
                                                  attention, rope_scaling):
    """The flags reach model.generate as the rule and interpolation they name, and
    generation runs with them."""
    make_checkpoint(tmp_path / "m.pt", tiny_data, pos="rope", block_size=8)
    out = generate(capsys, "--ckpt", tmp_path / "m.pt", "--start", "abc",
                   "--max_new_tokens", 30, *argv)
    text = out.split("\n")[0]
    assert text.startswith("abc") and len(text) == 33 and set(text) <= set("abcdefghijk")
    seen = []
    monkeypatch.setattr(GPT, "generate", lambda self, x, n, t, k, **kw: seen.append(kw) or x)
    generate(capsys, "--ckpt", tmp_path / "m.pt", "--start", "abc", "--max_new_tokens", 30, *argv)
    assert seen == [dict(attention=attention, rope_scaling=rope_scaling)]


def test_an_explicit_scaling_on_a_fine_tune_is_its_own(tiny_data, tmp_path, capsys, monkeypatch):
    """As in eval_extrapolate.py: on a YaRN fine-tune (s = 2 from an original length of 4, at
    block_size 16), its own method and factor given explicitly decode with its own scaling, YaRN's
    ramp over 4 (not over block_size), and give the same samples."""
    make_checkpoint(tmp_path / "s.pt", tiny_data, pos="rope", block_size=16, rope_scaling="yarn",
                    rope_factor=2.0, rope_original_length=4)
    seen = []
    generate_ = GPT.generate

    def spy(self, *args, **kwargs):
        seen.append(kwargs["rope_scaling"])
        return generate_(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "generate", spy)
    argv = ["--ckpt", tmp_path / "s.pt", "--start", "abc", "--max_new_tokens", 30]
    own = generate(capsys, *argv)
    explicit = generate(capsys, *argv, "--rope_scaling", "yarn", "--rope_factor", 2)
    assert explicit == own and seen == [RopeScaling("yarn", 2.0, 4)] * 2


@pytest.mark.parametrize("argv", [[], ["--bca", "off"]])
def test_a_factor_from_the_length_that_is_not_its_own_is_refused(tiny_data, tmp_path, argv):
    """--rope_scaling yarn without --rope_factor on a fine-tune whose s is not block_size / l:
    the dynamic rule would not give it its own angles; one line naming what is allowed, under
    every rule."""
    make_checkpoint(tmp_path / "s.pt", tiny_data, pos="rope", block_size=16, rope_scaling="yarn",
                    rope_factor=2.0, rope_original_length=4)
    with pytest.raises(SystemExit) as e:
        sample.main(["--ckpt", str(tmp_path / "s.pt"), "--max_new_tokens", "5",
                     "--rope_scaling", "yarn", *argv])
    assert ("yarn without --rope_factor takes s = max(L, block_size) / 4, 4 up to block_size "
            "(16), not the yarn s=2 from 4 this checkpoint was trained with: give --rope_factor, "
            "or leave out --rope_scaling for its own") in str(e.value.code)


def test_pointless_or_several_rules_are_errors(tiny_data, tmp_path):
    make_checkpoint(tmp_path / "alibi.pt", tiny_data, pos="alibi", block_size=8)
    for argv, message in ((["--rope_scaling", "yarn"],
                           "yarn rescales rotary angles, and pos=alibi has none"),
                          (["--attention", "bca,sliding"],
                           "--attention 'bca,sliding': this script takes one value")):
        with pytest.raises(SystemExit) as e:
            sample.main(["--ckpt", str(tmp_path / "alibi.pt"), "--max_new_tokens", "5", *argv])
        assert message in str(e.value.code)


def test_seed_temperature_weights_and_prompt_file_are_checked(tiny_data, tmp_path):
    """Each a one-line error (they were tracebacks): torch takes no seed >= 2^64, logits / 1e-40
    overflow float32, NaN weights give NaN probabilities, and a prompt file that cannot be read."""
    import torch

    from lexgpt.checkpoint import save_checkpoint
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    ckpt = torch.load(tmp_path / "m.pt", weights_only=True)
    for weight in ckpt["model"].values():
        weight.fill_(float("nan"))
    save_checkpoint(ckpt, tmp_path / "nan.pt")
    for argv, message in (
        (["--seed", str(10**23)],
         f"--seed {10**23} is not allowed: must be an integer from 0 to 2**63 - 1"),
        (["--seed", "-1"], "--seed -1 is not allowed"),
        (["--temperature", "1e-40"], "--temperature 1e-40 must be > 0: a finite number >= 0.0001"),
        (["--temperature", "inf"], "--temperature inf must be > 0: a finite number"),
        (["--start", "FILE:" + str(tmp_path / ("x" * 300))], "is not readable: File name too long"),
        (["--ckpt", str(tmp_path / "nan.pt")], "nan.pt holds non-finite weights (inf or NaN)"),
    ):
        with pytest.raises(SystemExit) as e:
            sample.main(["--ckpt", str(tmp_path / "m.pt"), "--max_new_tokens", "3", *argv])
        assert message in str(e.value.code) and "\n" not in str(e.value.code)

def test_torchrun_is_refused_once(tiny_data, tmp_path, capsys, monkeypatch):
    """Under torchrun every rank printed every sample: sample.py runs as one process, and says so
    from rank 0 only."""
    from lexgpt import cli
    from test_common import torchrun_vars
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    monkeypatch.setattr(cli, "QUIET_EXIT_SECONDS", 0, raising=False)
    for rank, said in ((0,
                        "sample.py: error: RANK=0 is set (torchrun?): sample.py runs as one "
                        "process; run it with "
                           "python, not torchrun"), (1, 1)):
        torchrun_vars(monkeypatch, rank)
        with pytest.raises(SystemExit) as e:
            sample.main(["--ckpt", str(tmp_path / "m.pt"), "--max_new_tokens", "4"])
        assert e.value.code == said and capsys.readouterr().out == ""


def test_samples_without_bca_far_past_float32s_range(tiny_data, tmp_path, capsys):
    """--bca off after a 4,000-token prompt with scale_base = l/2: one factor over the sequence
    would be 3.5^500 (the issue's sample.py attack ended in an OverflowError, or
    NaN probabilities)."""
    from test_eval_extrapolate import steep_xpos_checkpoint
    steep_xpos_checkpoint(tmp_path / "m.pt", tiny_data)
    (tmp_path / "prompt.txt").write_text("abcdefghijk" * 364)  # 4,004 tokens
    out = generate(capsys, "--ckpt", tmp_path / "m.pt",
                   "--start", f"FILE:{tmp_path / 'prompt.txt'}", "--bca", "off",
                   "--max_new_tokens", 3)
    text = out.split("\n")[0]
    assert len(text) == 4007 and set(text) <= set("abcdefghijk")
