"""Tests for eval_retrieval.py: the probes' sequences built right, gain and effective context by
hand on stubbed models, the JSON shape, and one-line errors."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import prepare_data
from conftest import make_checkpoint
from lexgpt import checkpoint, data
from lexgpt.data import PASSKEY_CHARS, Tokenizer
from lexgpt.inference_options import Runtime, Variant, default_batch_tokens
from model import RopeScaling
from study import eval_retrieval


def run(*argv):
    return eval_retrieval.main([str(a) for a in argv])


def test_repeat_sequences_are_span_filler_span_with_nothing_shared():
    # every token is its own position: overlaps would show as repeated values
    stream = np.arange(1000)
    for d in (0, 5, 100):
        probe, control = eval_retrieval.repeat_sequences(stream, 8, d, 20, seed=3)
        assert probe.shape == control.shape == (20, 16 + d)
        for p, c in zip(probe.tolist(), control.tolist()):
            first, filler, second = p[:8], p[8 : 8 + d], p[8 + d :]
            other = c[:8]
            assert first == second and c[8:] == p[8:]  # the control differs only in its first copy
            for stretch in (first, filler, other):  # each a contiguous piece of the stream
                assert (stretch == list(range(stretch[0], stretch[0] + len(stretch))) if stretch
                        else True)
            assert (not set(first) & set(filler) and not set(other) & set(first)
                    and not set(other) & set(filler))
    again, _ = eval_retrieval.repeat_sequences(stream, 8, 5, 20, seed=3)
    # seeded
    assert torch.equal(again, eval_retrieval.repeat_sequences(stream, 8, 5, 20, seed=3)[0])
    assert not torch.equal(again, eval_retrieval.repeat_sequences(stream, 8, 5, 20, seed=4)[0])


class Copier:
    """A stub model: NLL 0.5 for a token that appeared earlier in the sequence within `reach`
    positions, else 2."""

    def __init__(self, reach):
        self.reach = reach

    def token_nll(self, idx, targets, **kw):
        B, T = idx.shape
        full = torch.cat((idx, targets[:, -1:]), dim=1)
        out = torch.full((B, T), 2.0)
        for b in range(B):
            for t in range(T):
                seen = full[b, max(0, t + 1 - self.reach) : t + 1].tolist()
                if full[b, t + 1].item() in seen:
                    out[b, t] = 0.5
        return out


def test_gain_and_effective_context_by_hand():
    stream = np.arange(5000)
    rows = []
    for d in (0, 10, 40, 100):
        probe, control = eval_retrieval.repeat_sequences(stream, 6, d, 4, seed=0)
        loss, ctrl = (eval_retrieval.second_copy_nll(Copier(reach=30), s, 6,
                                                     Variant(None, None, 10**6), Runtime("cpu"))
                      for s in (probe, control))
        gain, stderr = eval_retrieval.retrieval_gain(loss, ctrl)
        # tokens 1..5 of the second copy: copied (0.5) while the first copy is within
        # reach, else 2, control 2
        want = 1 - 0.5 / 2 if d + 6 <= 30 else 0.0
        assert gain == pytest.approx(want) and stderr == pytest.approx(0.0, abs=1e-12)
        rows.append(dict(d=d, gain=gain))
    assert eval_retrieval.effective_context(rows) == 10
    assert eval_retrieval.effective_context([dict(d=0, gain=-0.1), dict(d=5, gain=0.2)]) is None


def test_standard_error_is_the_delta_method_written_out():
    loss, control = (torch.tensor([1.0, 2.0, 1.5, 0.5], dtype=torch.float64),
                     torch.tensor([2.0, 2.5, 2.0, 1.5], dtype=torch.float64))
    gain, stderr = eval_retrieval.retrieval_gain(loss, control)
    r = loss.mean() / control.mean()
    assert gain == pytest.approx(1 - 5.0 / 8.0)
    residual = [(x - r * y).item() for x, y in zip(loss, control)]
    mean = sum(residual) / 4
    want = math.sqrt(sum((e - mean) ** 2 for e in residual) / 3) / (2 * control.mean().item())
    assert stderr == pytest.approx(want)


def test_repeat_probe_json_table_and_plot(tiny_data, tmp_path, capsys):
    make_checkpoint(tmp_path / "m.pt", tiny_data, block_size=8)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rows = run("--ckpt", tmp_path / "m.pt", "--span", 4, "--distances", "0,3,7", "--sequences", 5,
               "--attention", "causal,bca", "--json", out, "--plot", png)
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [(r["attention"], r["d"], r["n"]) for r in result["rows"]] == [
        ("causal", 0, 5), ("causal", 3, 5), ("causal", 7, 5), ("bca", 0, 5), ("bca", 3, 5),
        ("bca", 7, 5)]
    assert set(result["rows"][0]) == {"ckpt", "pos", "attention", "bca", "window", "sinks",
                                      "rope_scaling", "rope_factor", "rope_original_length",
                                      "yarn_alpha", "yarn_beta", "probe", "d", "gain",
                                      "gain_stderr", "n", "loss", "control_loss",
                                      "effective_context", "reach_bound", "label"}
    assert (result["rows"][3]["reach_bound"] == 2 * 8 // 2
            and result["rows"][0]["reach_bound"] is None)
    assert ("| xpos + BCA | " in printed
            and "reach bound n_layer x block_size/2 = 8 tokens" in printed)
    assert len(rows) == 6 and png.stat().st_size > 1000


@pytest.mark.parametrize("argv, message", [
    (["--distances", "0,50"], "distance 50 needs 2 x 114 = 228 validation tokens"),
    (["--distances", "0,x"], "--distances '0,x' must be comma-separated integers"),
    (["--distances", "-1"], "--distances '-1' must be >= 0"),
    (["--span", 1], "--span 1 is not allowed: must be >= 2"),
    (["--probe", "task", "--sequences", 0], "--sequences 0 is not allowed: must be >= 1"),
    (["--attention", "window"], "--attention 'window' is not allowed"),
    (["--depths", "0.5"], "--depths does not apply to --probe repeat"),
    (["--probe", "passkey", "--distances", "0,8"], "--distances does not apply to --probe passkey"),
])
def test_bad_inputs_are_one_line_errors(tiny_data, tmp_path, argv, message):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", *argv)
    assert message in str(e.value.code)


def test_unknown_probe_and_learned_past_block_size(tiny_data, tmp_path, capsys):
    make_checkpoint(tmp_path / "learned.pt", tiny_data, pos="learned", block_size=8)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "learned.pt", "--span", 4, "--distances", "0,4")
    assert "pos='learned' cannot go past block_size=8 (asked for 12 positions)" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "learned.pt", "--probe", "needle")
    assert "invalid choice: 'needle'" in str(e.value.code) and "\n" not in str(e.value.code)


# --- passkey --------------------------------------------------------------------------------------


def test_passkey_documents_are_filler_key_filler_question():
    tokenizer = Tokenizer("char", sorted(set("abcdefghij") | PASSKEY_CHARS))
    stream = np.array(tokenizer.encode("abcdefghij" * 100))
    for length, depth in ((120, 0.0), (200, 0.5), (300, 1.0)):
        batches = eval_retrieval.passkey_batches(stream, tokenizer, length, depth, 6, seed=1)
        (prompts, answers, keys), = batches  # char level: every document has the same shape
        assert prompts.size(1) + answers.size(1) == length and len(keys) == 6 and len(set(keys)) > 1
        for prompt, answer, key in zip(prompts.tolist(), answers.tolist(), keys):
            text = tokenizer.decode(prompt)
            sentence = f" The pass key is {key}. Remember it. "
            assert (text.endswith(" What is the pass key? The pass key is")
                    and tokenizer.decode(answer) == f" {key}.")
            filler = text.replace(sentence, "", 1)[: -len(" What is the pass key? The pass key is")]
            # filler is validation text only
            assert sentence in text and set(filler) <= set("abcdefghij")
            assert text.index(sentence) == round(depth * len(filler))  # the key at its depth
            assert filler in "abcdefghij" * 100  # one contiguous stretch of the stream


class Answerer:
    """A stub model whose generate answers right (the key after the prompt's sentence)
    or wrong (zeros)."""

    def __init__(self, tokenizer, right):
        self.tokenizer, self.right = tokenizer, right

    def generate(self, prompts, n, top_k=None, **kw):
        new = []
        for prompt in prompts.tolist():
            text = self.tokenizer.decode(prompt)
            key = text.split("The pass key is ")[1][:5]
            new.append(self.tokenizer.encode(f" {key}.")[:n] if self.right else [0] * n)
        return torch.cat((prompts, torch.tensor(new)), dim=1)


def test_passkey_accuracy_on_models_forced_right_or_wrong():
    tokenizer = Tokenizer("char", sorted(set("abcdefghij") | PASSKEY_CHARS))
    stream = np.array(tokenizer.encode("abcdefghij" * 100))
    batches = eval_retrieval.passkey_batches(stream, tokenizer, 150, 0.5, 7, seed=0)
    for right, want in ((True, 1.0), (False, 0.0)):
        accuracy, n = eval_retrieval.passkey_accuracy(Answerer(tokenizer, right), tokenizer,
                                                      batches, Variant(None, None, None),
                                                      Runtime("cpu"))
        assert (accuracy, n) == (want, 7)


def test_passkey_probe_json_table_and_heatmap(tmp_path, capsys):
    corpus = tmp_path / "c"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text(f"Play {i}.\n" + "It was a dark night, and so on. " * 40)
    prepare_data.main(["--dataset", "files", "--path", str(corpus),
                       "--out_dir", str(tmp_path / "d"), "--passkey", "0.2",
                       "--passkey_tokens", "100", "--val_fraction", "0.34"])
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    make_checkpoint(tmp_path / "m.pt", tmp_path / "d", block_size=128, vocab=meta["chars"])
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    run("--ckpt", tmp_path / "m.pt", "--probe", "passkey", "--lengths", "100,200",
        "--depths", "0,1", "--sequences", 3, "--attention", "causal,sliding", "--window", 64,
        "--json", out, "--plot", png)
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [(r["attention"], r["length"], r["depth"], r["n"]) for r in result["rows"]] == [
        (a, n, d, 3) for a in ("causal", "sliding") for n in (100, 200) for d in (0.0, 1.0)]
    assert set(result["rows"][0]) == {"ckpt", "pos", "attention", "bca", "window", "sinks",
                                      "rope_scaling", "rope_factor", "rope_original_length",
                                      "yarn_alpha", "yarn_beta", "probe", "length", "depth",
                                      "accuracy", "n", "label"}
    assert all(0 <= r["accuracy"] <= 1 for r in result["rows"]) and result["depths"] == [0.0, 1.0]
    assert ("| xpos + sliding W=64: depth \\ length | 100 | 200 |" in printed
            and png.stat().st_size > 1000)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", "--probe", "passkey", "--lengths", "50")
    assert "--lengths: 50 tokens cannot hold a passkey document" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", "--probe", "passkey", "--depths", "0,1.5")
    assert "--depths '0,1.5' must lie in [0, 1]" in str(e.value.code)


@pytest.mark.parametrize("argv, message", [
    (["--seed", "-1"], "--seed -1 is not allowed: must be an integer from 0 to 2**63 - 1"),
    (["--seed", str(10**23)], f"--seed {10**23} is not allowed"),
    (["--probe", "passkey", "--depths", "nan"], "--depths 'nan' must lie in [0, 1]"),
    (["--probe", "passkey", "--depths", "0.5,nan"], "--depths '0.5,nan' must lie in [0, 1]"),
])
def test_seeds_and_non_finite_depths_are_one_line_errors(tiny_data, tmp_path, argv, message):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", "--sequences", 1, *argv)
    assert message in str(e.value.code)


def test_the_learning_rate_trials_in_the_docs_match_their_json():
    """docs/retrieval.md's table of the trials at half the learning rate is their committed
    JSON, cell by cell."""
    root = Path(__file__).resolve().parents[2]
    runs = {"alibi": "alibi_lr1.5e-3_s1338", "rope": "rope_lr1.5e-3_s1339"}
    rows = {scheme: json.loads((root / f"results/retrieval_trials/{run}.tasks.json")
                               .read_text())["rows"]
            for scheme, run in runs.items()}
    lines = [line for line in (root / "docs/retrieval.md").read_text().splitlines()
             if line.startswith(tuple(f"| {scheme} 1.5e-3: " for scheme in runs))]
    assert len(lines) == 10
    for line in lines:
        label, at_1x, *by_d, reach, at_2048 = [cell.strip() for cell in line.strip("|").split("|")]
        scheme, task = label.split()[0], label.split(": ")[1]
        mine = [r for r in rows[scheme] if r["task"] == task]
        at = {r["d"]: r["accuracy"] for r in mine if r["kind"] == "distance"}
        assert f"{mine[0]['accuracy_1x']:.2f}" == at_1x and str(mine[0]["retrieval_reach"]) == reach
        assert [f"{at[d]:.2f}" for d in (256, 512, 768, 1024, 2048)] == by_d
        assert format(next(r["accuracy"] for r in mine
                           if r["kind"] == "length" and r["length"] == 2048), ".2f") == at_2048


def test_the_natural_text_tables_in_the_docs_match_their_json():
    """docs/retrieval.md's repeat-probe and passkey tables for the code models trained on a GPU are
    their committed JSON (results/code_gpt2), cell by cell: the gain ± its standard error, the
    passkey accuracy as the mean over the depths of each length."""
    root = Path(__file__).resolve().parents[2]
    page = ((root / "docs/retrieval.md").read_text()
            .split("## Natural text on a GPU")[1].split("\n## ")[0])
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in page.splitlines()
             if line.startswith(("| xpos", "| rope"))]
    headers = [line for line in page.splitlines() if line.startswith("| model")]
    assert headers == ["| model | " + " | ".join(f"d = {d}" for d in
                                                 (0, 32, 64, 128, 256, 512, 1024, 2048, 4096))
                       + " |",
                       "| model (mean over the five depths) | 256 | 512 | 1024 | 2048 | 4096 |"]
    repeat = [json.loads((root / f"results/code_gpt2/{m}.repeat.json").read_text())["rows"]
              for m in ("xpos", "rope")]
    passkey = [json.loads((root / f"results/code_gpt2/{m}.passkey.json").read_text())["rows"]
               for m in ("xpos", "rope")]
    labels = [r["label"] for rows in repeat for r in rows if r["d"] == 0]
    assert labels == ["xpos", "xpos + BCA", "xpos + sliding W=256", "rope", "rope + BCA",
                      "rope + sliding W=256"]
    assert [row[0] for row in table] == labels * 2
    bounds = {r["label"]: r["reach_bound"] for rows in repeat for r in rows}
    assert (bounds["xpos + BCA"] == bounds["rope + BCA"] == 768
            and bounds["xpos + sliding W=256"] == 1530)
    assert "reach bound is 768 under BCA and 1,530\nunder the window" in page
    for row, label in zip(table[:6], labels):
        mine = sorted((r for rows in repeat for r in rows if r["label"] == label),
                      key=lambda r: r["d"])
        assert [r["d"] for r in mine] == [0, 32, 64, 128, 256, 512, 1024, 2048, 4096]
        assert row[1:] == [f"{r['gain']:.3f} ± {r['gain_stderr']:.3f}" for r in mine]
    for row, label in zip(table[6:], labels):
        mine = [r for rows in passkey for r in rows if r["label"] == label]
        by_length = {}
        for r in mine:
            by_length.setdefault(r["length"], []).append(r["accuracy"])
        assert (sorted(by_length) == [256, 512, 1024, 2048, 4096]
                and all(len(v) == 5 for v in by_length.values()))
        assert row[1:] == [f"{sum(v) / len(v):.2f}" for _, v in sorted(by_length.items())]


def first_span(ckpt, data_dir):
    """The checkpoint's model and the inputs and targets of the first validation document's only
    33-token span, for brute-force scoring."""
    model, _ = checkpoint.load_model(ckpt, "cpu")
    stream = data.read_tokens(data_dir, "val", data.load_meta(data_dir)).tokens
    span = torch.from_numpy(np.asarray(stream[:33]).astype(np.int64))[None]
    return model, span[:, :-1], span[:, 1:]


def nll(logits, target):
    return torch.nn.functional.cross_entropy(logits[0].double(), target[0]).item()


@pytest.mark.parametrize("attention, beyond", [("bca", None), ("causal", None), ("bca", 4)])
def test_context_gain_against_each_window_scored_alone(tiny_data, tmp_path, attention, beyond):
    """The context probe by brute force: every position's NLL given only its L tokens (a forward
    pass of that window; L = l, or --beyond), given the whole span under the rule, and in chunks of
    L, each computed on its own; the gain, its bins and the lex fall's split follow from them as the
    docstring defines them."""
    ckpt = tmp_path / "m.pt"
    make_checkpoint(ckpt, tiny_data, pos="xpos", block_size=8, seed=3)
    out, L = tmp_path / "c.json", beyond or 8
    eval_retrieval.main([str(a) for a in ("--ckpt", ckpt, "--probe", "context", "--lengths", 32,
                                          "--sequences", 1, "--stride", 1, "--attention", attention,
                                          "--json", out)]
                        + (["--beyond", str(beyond)] if beyond else []))
    row = json.loads(out.read_text())["rows"][0]
    assert row["beyond"] == L
    model, x, y = first_span(ckpt, tiny_data)
    full = [nll(model(x, y, attention=attention)[0][:, p : p + 1], y[:, p : p + 1])
            for p in range(32)]
    ref = {p: nll(model(x[:, p - L + 1 : p + 1], y[:, p - L + 1 : p + 1],
                        attention="causal")[0][:, -1:], y[:, p : p + 1])
           for p in range(L, 32)}
    short = [nll(model(x[:, j : j + L], y[:, j : j + L], attention=attention)[0][:, i : i + 1],
                 y[:, j + i : j + i + 1]) for j in range(0, 32, L) for i in range(L)]
    gain = [ref[p] - full[p] for p in range(L, 32)]
    assert row["per_span"]["gain"][0] == pytest.approx(np.mean(gain), abs=1e-5)
    assert [(b["start"], b["end"]) for b in row["by_bin"]] == [(8, 16), (16, 32)] if L == 8 else \
        [(4, 8), (8, 16), (16, 32)]
    assert row["by_bin"][-1]["gain"] == pytest.approx(np.mean(gain[16 - L:]), abs=1e-5)
    fall = np.mean(short) - np.mean(full)
    used = (32 - L) / 32 * np.mean(gain)
    assert (row["fall"] == pytest.approx(fall, abs=1e-5)
            and row["used"] == pytest.approx(used, abs=1e-5))
    assert row["used"] + row["early"] == pytest.approx(row["fall"])
    # the rest: less context in chunks
    early = np.mean([short[p] - ref[p] for p in range(L, 32)]) * (32 - L) / 32
    assert row["early"] == pytest.approx(early, abs=1e-5)
    # the plain model sees everything: the same pass as eval_extrapolate.py's lex protocol
    if attention == "causal":
        assert np.mean(full) == pytest.approx(model(x, y, attention="causal")[1].item(), abs=1e-5)
    # against the reference matched to the rule: under BCA the window of the query's own and the
    # previous segment of w = 4 (what one layer attends to), so the gain is relay alone
    w = 4
    starts = {p: (p // w - 1) * w if attention == "bca" else p - L + 1 for p in range(L, 32)}
    matched = {p: nll(model(x[:, starts[p] : p + 1], y[:, starts[p] : p + 1],
                            attention="causal")[0][:, -1:], y[:, p : p + 1])
               for p in range(L, 32)}
    relay = [matched[p] - full[p] for p in range(L, 32)]
    assert row["per_span"]["matched_gain"][0] == pytest.approx(np.mean(relay), abs=1e-5)
    assert row["matched_by_bin"][-1]["gain"] == pytest.approx(np.mean(relay[16 - L:]), abs=1e-5)
    assert row["matched_reference"] == ("BCA's direct window, from the previous segment's start"
                                        if attention == "bca" else f"the last {L} tokens")


def test_an_interpolations_reference_is_under_the_same_scaling(tiny_data, tmp_path):
    """YaRN whose s follows the length is s = 32 / 8 = 4 over a 32-token span: its matched
    reference scores the last l tokens at that s too, so that YaRN's cost inside the window is not
    counted as context unused. Brute force, each window a pass of its own."""
    ckpt = tmp_path / "m.pt"
    make_checkpoint(ckpt, tiny_data, pos="rope", block_size=8, seed=3)
    out = tmp_path / "c.json"
    eval_retrieval.main([str(a) for a in ("--ckpt", ckpt, "--probe", "context", "--lengths", 32,
                                          "--sequences", 1, "--stride", 3, "--attention",
                                          "causal", "--rope_scaling", "yarn", "--json", out)])
    row = json.loads(out.read_text())["rows"][0]
    model, x, y = first_span(ckpt, tiny_data)
    yarn4 = RopeScaling("yarn", 4.0)
    full = model(x, y, attention="causal", rope_scaling=yarn4)[0]
    positions = range(8, 32, 3)
    gain, matched = [], []
    for p in positions:
        at = nll(full[:, p : p + 1], y[:, p : p + 1])
        window = x[:, p - 7 : p + 1], y[:, p - 7 : p + 1]
        gain.append(nll(model(*window, attention="causal")[0][:, -1:], y[:, p : p + 1]) - at)
        matched.append(nll(model(*window, attention="causal", rope_scaling=yarn4)[0][:, -1:],
                           y[:, p : p + 1]) - at)
    # (this untrained model barely minds the scaling: the two differ by 4e-6 here)
    assert row["per_span"]["gain"][0] == pytest.approx(np.mean(gain), abs=5e-7)
    assert row["per_span"]["matched_gain"][0] == pytest.approx(np.mean(matched), abs=5e-7)
    assert abs(np.mean(gain) - np.mean(matched)) > 2e-6
    assert row["matched_reference"] == "the last 8 tokens, under yarn s=4"


def test_context_probe_flags_are_one_line_errors(tiny_data, tmp_path):
    make_checkpoint(tmp_path / "m.pt", tiny_data, block_size=8)
    for argv, message in ((["--lengths", "8"], "takes one length, above block_size 8"),
                          (["--lengths", "16,32"], "takes one length"),
                          (["--lengths", "32", "--sequences", "5"],
                           "--sequences 5: the validation text has only 1"),
                          (["--stride", "0"], "--stride 0 is not allowed"),
                          (["--span", "4"], "--span does not apply to --probe context"),
                          (["--beyond", "16"], "--beyond 16 is not allowed for"),
                          (["--beyond", "1"], "--beyond 1 is not allowed for")):
        with pytest.raises(SystemExit) as e:
            eval_retrieval.main(["--ckpt", str(tmp_path / "m.pt"), "--probe", "context", *argv])
        assert message in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        eval_retrieval.main(["--ckpt", str(tmp_path / "m.pt"), "--probe", "repeat",
                             "--stride", "2"])
    assert "--stride does not apply to --probe repeat" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        eval_retrieval.main(["--ckpt", str(tmp_path / "m.pt"), "--probe", "repeat",
                             "--beyond", "4"])
    assert "--beyond does not apply to --probe repeat" in str(e.value.code)


def test_repeat_sequences_where_the_rule_acts_sit_at_every_phase():
    # every token unique: where each piece came from is readable off its values
    stream = np.arange(5000)
    probe, control, starts = eval_retrieval.repeat_sweep_sequences(stream, 6, 20, 40, seed=1, l=16)
    # one length at every phase
    assert probe.shape == control.shape == (40, 2 * 16 + 7 + 2 * 6 + 20)
    # the first scored token's query, s, at every phase
    assert {(s - 1 + 1) % 8 for s in starts} == set(range(8))
    for p, c, s in zip(probe, control, starts):
        assert s - 26 >= 32  # the first copy after 2l of prefix
        assert (torch.equal(p[s : s + 6], p[s - 26 : s - 20])
                and torch.equal(c[s : s + 6], p[s : s + 6]))
        # the control's other text
        assert not set(c[s - 26 : s - 20].tolist()) & set(p[s : s + 6].tolist())
        assert torch.equal(p[: s - 26], c[: s - 26]) and torch.equal(p[s - 20 :], c[s - 20 :])
        assert len(set(p.tolist())) == len(p) - 6  # nothing else repeats


def test_the_repeat_sweep_counts_each_token_in_its_zone():
    """A stub that copies within `reach` tokens: each second-copy token scores 0.5 against the
    control's 2 exactly when its first copy is within reach; the zones follow the rule's sight for
    the span + d - 1 tokens back."""
    from types import SimpleNamespace

    from model import AttentionRule, GPTConfig, RopeScaling
    config = GPTConfig(block_size=16, vocab_size=5000, n_layer=2, n_head=2, n_embd=16)
    args = SimpleNamespace(span=6, sequences=16, seed=0, batch_tokens=None, verbose=False)
    variant = Variant(AttentionRule("bca"), RopeScaling(),
                      default_batch_tokens(config, RopeScaling()))
    pf = eval_retrieval.Preflight("m.pt", config, None, None, [2, 40], [variant], [])
    rows = eval_retrieval.repeat_sweep_rows(args, pf, Copier(reach=30), np.arange(5000),
                                            Runtime("cpu"))
    near, far = rows
    assert near["gain"] == pytest.approx(1 - 0.5 / 2) and far["gain"] == pytest.approx(0)
    assert near["zones"]["direct"] == [pytest.approx(16 * 5 * 0.5), pytest.approx(16 * 5 * 2.0),
                                       16 * 5]
    assert far["zones"]["beyond"][2] == 16 * 5  # 45 back: past n_layer x H + phase <= 23
    assert (near["reach_bound"], near["reach_bound_max"]) == (16, 23) and near["kind"] == "sweep"


def test_repeat_sweep_json_table_and_plot(tiny_data, tmp_path, capsys):
    make_checkpoint(tmp_path / "m.pt", tiny_data, block_size=8)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    eval_retrieval.main([str(a) for a in ("--ckpt", tmp_path / "m.pt", "--probe", "repeat",
                                          "--sweep", "--span", 2, "--distances", "0,4",
                                          "--sequences", 3, "--attention", "causal,bca",
                                          "--json", out, "--plot", png)])
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["label"], r["d"]) for r in rows] == [("xpos", 0), ("xpos + BCA", 0), ("xpos", 4),
                                                    ("xpos + BCA", 4)]
    assert all(sum(n for _, _, n in r["zones"].values()) == 3 * 1 for r in rows)
    assert ("where the rule acts" in printed and "| xpos + BCA | " in printed
            and png.stat().st_size > 1000)


@pytest.mark.parametrize("name, head", [("thesis.pdf", b"%PDF-1.4\n% my thesis"),
                                        ("holiday.png", b"\x89PNG\r\n\x1a\n my holiday")])
def test_plot_keeps_a_user_file_that_looks_like_an_image(tiny_data, tmp_path, name, head):
    """Issue 45 item 8: --plot thesis.pdf replaced a user's PDF (its first bytes are a PDF's),
    status 0."""
    make_checkpoint(tmp_path / "m.pt", tiny_data, pos="rope", block_size=16)
    (tmp_path / name).write_bytes(head)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", "--probe", "repeat", "--sequences", "2",
            "--distances", "0,16", "--span", "4", "--plot", tmp_path / name)
    assert f"--plot {tmp_path / name} exists and is not an earlier plot" in str(e.value.code)
    assert (tmp_path / name).read_bytes() == head


def test_json_and_plot_never_name_one_file(tiny_data, tmp_path):
    """Issue 45 item 7: --json F --plot F wrote one over the other, status 0."""
    make_checkpoint(tmp_path / "m.pt", tiny_data, pos="rope", block_size=16)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", "--probe", "repeat", "--sequences", "2",
            "--distances", "0,16", "--span", "4", "--json", tmp_path / "r.png",
            "--plot", tmp_path / "r.png")
    assert f"--json and --plot name the same file {tmp_path / 'r.png'}" in str(e.value.code)
    assert not (tmp_path / "r.png").exists()


@pytest.mark.parametrize("probe", ["repeat", "passkey"])
def test_sequences_that_cannot_fit_are_refused_before_any_work(tiny_data, tmp_path, probe):
    """Issue 45 item 16: --sequences 100000000 built the sequences until memory ran out
    (repeat 0.79 -> 2.38 GB in 27 s), nothing printed. (The task probe: test_retrieval_tasks.)"""
    data = tiny_data
    if probe == "passkey":
        (tmp_path / "c").mkdir()
        for i in range(3):
            (tmp_path / "c" / f"{i}.txt").write_text("It was a dark night, and so on. " * 20)
        data = tmp_path / "d"
        prepare_data.main(["--dataset", "files", "--path", str(tmp_path / "c"), "--out_dir",
                           str(data), "--passkey", "0.5", "--passkey_tokens", "100",
                           "--val_fraction", "0.34"])
    meta = json.loads((data / "meta.json").read_text())
    make_checkpoint(tmp_path / "m.pt", data, pos="rope", block_size=16, vocab=meta["chars"])
    extra = {"repeat": ["--span", "4", "--distances", "0,8"], "passkey": ["--lengths", "100"]}
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", "--probe", probe, "--sequences", "100000000",
            *extra[probe])
    assert (f"--sequences 100000000 is not allowed for {tmp_path / 'm.pt'}: 100,000,000 "
            "sequences of up to") in str(e.value.code)
    assert f"tokens are more than {eval_retrieval.MAX_PROBE_TOKENS:,} tokens at once" \
        in str(e.value.code)


def test_errors_name_the_flags_of_this_script(tiny_data, tmp_path):
    """Issue 45 items 20 and 24: errors named --tasks (prepare_data.py's) for --task, --max_len
    and --spans (eval_extrapolate.py's) for --lengths and --sequences, blamed --lengths for --sweep
    on the context probe, and --beyond 0 was taken as block_size."""
    make_checkpoint(tmp_path / "m.pt", tiny_data, pos="rope", block_size=16)
    for argv, message in ((["--probe", "task", "--task", "bogus"], "--task 'bogus': bogus not "
                           "allowed: the tasks are"),
                          (["--probe", "context", "--sweep"],
                           "--sweep applies to --probe task and repeat only, not --probe context"),
                          (["--probe", "context", "--beyond", "0"],
                           "--beyond 0 is not allowed for"),
                          (["--probe", "context", "--lengths", "600000"],
                           "(the longest has 40): lower --lengths"),
                          (["--probe", "context", "--lengths", "32", "--sequences", "100000"],
                           "--sequences 100000: the validation text has only")):
        with pytest.raises(SystemExit) as e:
            run("--ckpt", tmp_path / "m.pt", *argv)
        assert message in str(e.value.code), argv


def test_nothing_to_score_is_an_error(tiny_data, tmp_path):
    """Issue 45 item 1: with every combination skipped (here --rope_scaling yarn without a factor
    on a YaRN fine-tune whose s is not block_size / l) the probe printed an empty table, status
    0."""
    make_checkpoint(tmp_path / "m.pt", tiny_data, pos="rope", block_size=16, rope_scaling="yarn",
                    rope_factor=3.0, rope_original_length=8)
    with pytest.raises(SystemExit) as e:
        run("--ckpt", tmp_path / "m.pt", "--probe", "repeat", "--sequences", "2", "--span", "4",
            "--distances", "0,8", "--rope_scaling", "yarn", "--json", tmp_path / "r.json")
    assert "nothing to score: every combination is skipped: " in str(e.value.code)
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("l, block_size, want", [(128, 128, 17), (64, 64, 9), (96, 96, 13),
                                                  (128, 512, 17), (8, 8, 1)])
def test_the_default_stride_scores_every_phase_of_bcas_segments(l, block_size, want):
    """Issue 46 item 5: stride 16 against segments of 64 scored 4 of their 64 phases. The default
    is the first stride from l/8 up that shares no factor with block_size/2: every phase, each
    equally often over a whole number of segments (brute force)."""
    stride = eval_retrieval.default_stride(l, block_size)
    assert stride == want
    w = block_size // 2
    phases = [p % w for p in range(l, l + stride * w, stride)]
    assert sorted(phases) == list(range(w))
