"""Tests for resolution.py: Eq. 3 on hand-computed cases, the Eq. 11 estimator, BCA's hidden
distances, Eq. 8."""

import json
import math

import pytest
import torch

import resolution
from conftest import make_checkpoint
from lexgpt.checkpoint import save_checkpoint
from model import AttentionPlan, AttentionRule, RopeScaling, alibi_slopes


def test_resolution_hand_computed():
    assert resolution.resolution([0.0, 0.0, 0.0]) == pytest.approx(0.0)  # flat: no position signal
    # e^s = 2, 1: 2(2-1) / 3^2
    assert resolution.resolution([math.log(2), 0.0]) == pytest.approx(2 / 9)
    e = math.e
    want = (e**2 * (e**2 - e) + e * (e - 1)) / (e**2 + e + 1) ** 2  # strictly decreasing 2, 1, 0
    assert resolution.resolution([2.0, 1.0, 0.0]) == pytest.approx(want)
    # one dominant score
    assert resolution.resolution([50.0, 0.0, 0.0]) == pytest.approx(1.0, abs=1e-12)
    assert resolution.resolution([0.0, 1.0]) < 0  # increasing scores are penalised
    # a hidden distance counts as e^s = 0: p = (1/2, 1/2, 0) -> 1/2 (1/2 - 1/2) + 1/2 (1/2 - 0)
    assert resolution.resolution([0.0, 0.0, float("-inf")]) == pytest.approx(0.25)


def test_distance_estimator_on_a_synthetic_score_matrix():
    n_head, T = 2, 4
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    # (head, query, key)
    scores = torch.stack([100.0 * h + 10 * i + j for h in range(n_head)]).float()
    sums, counts = torch.zeros(n_head, T, dtype=torch.float64), torch.zeros(T, dtype=torch.float64)
    pos = torch.arange(T)
    resolution.accumulate(sums, counts, scores, pos, pos)
    # pairs at distance n: T - n (future keys are not counted)
    assert counts.tolist() == [4, 3, 2, 1]
    # distance 0: 0, 11, 22, 33; distance 1: 10, 21, 32; distance 2: 20, 31; distance 3: 30
    assert (sums[0] / counts).tolist() == [16.5, 21.0, 25.5, 30.0]
    assert (sums[1] / counts).tolist() == [116.5, 121.0, 125.5, 130.0]


@pytest.mark.parametrize("pos", ["xpos", "alibi"])
def test_measured_scores_match_a_full_score_matrix(tiny_data, tmp_path, pos):
    model = make_checkpoint(tmp_path / "m.pt", tiny_data, pos=pos, block_size=8, n_layer=1)
    T = 24
    idx = torch.randint(0, 11, (1, T), generator=torch.Generator().manual_seed(0))
    sums, counts = resolution.layer_score_sums(model, idx, AttentionRule("causal"), RopeScaling())
    with torch.no_grad():
        x = model.transformer.h[0].ln_1(model.transformer.wte(idx))
        q, k, _ = model.transformer.h[0].attn.c_attn(x).view(1, T, 3, 2, 8).permute(2, 0, 3, 1, 4)
    if pos == "xpos":  # at absolute positions: every score depends on the distance only
        table = AttentionPlan(model.config, T, "causal")
        q, k = table.rotate(q, k, range(T), range(T))
    s = (q @ k.transpose(-1, -2))[0] / math.sqrt(8)
    if pos == "alibi":
        p = torch.arange(T)
        s = s - alibi_slopes(2)[:, None, None] * (p[:, None] - p[None, :])
    for n in (0, 1, 7, 23):
        want = torch.stack([s[:, t, t - n] for t in range(n, T)], -1).double().mean(-1)
        torch.testing.assert_close(sums[0, :, n] / counts[n], want, rtol=1e-4, atol=1e-5)


def test_bca_hides_distances_beyond_the_window(tiny_data, tmp_path):
    make_checkpoint(tmp_path / "m.pt", tiny_data, block_size=8)
    out = tmp_path / "r.json"
    resolution.main(["--ckpt", str(tmp_path / "m.pt"), "--length", "32", "--bca", "both",
                     "--texts", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    off, on = result["modes"]
    # only the 40-token document is long enough
    assert (off["bca"], on["bca"], result["texts"]) == (False, True, 1)
    assert off["pairs"] == [32 - n for n in range(32)]
    assert all(c > 0 for c in on["pairs"][:8]) and all(c == 0 for c in on["pairs"][8:])
    assert (all(s is None for layer in on["s_hat"] for s in layer[8:])
            and None not in off["s_hat"][0])
    for mode in (off, on):
        assert (len(mode["R_layers"]) == len(mode["R_layers_per_head"]) == 2
                and len(mode["s_hat_heads"][0]) == 2)
        assert mode["R"] == pytest.approx(sum(mode["R_layers"]) / 2) and -1 < mode["R"] <= 1


def test_theory_rope_curve_is_a_cosine_sum(tmp_path):
    out = tmp_path / "theory.json"
    resolution.main(["--theory", "--head_dim", "16", "--max_dist", "300", "--json", str(out)])
    result = json.loads(out.read_text())
    # outputs.OUTPUT_MARK
    assert set(result) == {"rope", "xpos", "head_dim", "gamma", "scale_base", "written_by"}
    theta = [10000 ** (-2 * j / 16) for j in range(8)]
    for n in (0, 1, 17, 300):
        assert result["rope"]["g"][n] == pytest.approx(sum(math.cos(n * t) for t in theta),
                                                       abs=1e-4)
        zeta = [(2 * j + 0.4 * 16) / (1.4 * 16) for j in range(8)]
        want = sum(math.cos(n * t) * z ** (n / 512) for t, z in zip(theta, zeta))
        assert result["xpos"]["g"][n] == pytest.approx(want, abs=1e-4)
    assert len(result["rope"]["g"]) == 301 and result["rope"]["R"] == pytest.approx(
        resolution.resolution(result["rope"]["g"]))


def test_errors(tiny_data, tmp_path):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    for argv, message in ((["--ckpt", str(tmp_path / "m.pt"), "--length", "64"],
                           "the longest has 40"),
                          (["--ckpt", str(tmp_path / "m.pt")],
                           "give --theory, or --ckpt CKPT --length T"),
                          (["--theory", "--head_dim", "7"], "--head_dim must be even"),
                          (["--theory", "--gamma", "0"], "xpos_gamma=0.0 is not allowed"),
                          (["--theory", "--ckpt", str(tmp_path / "m.pt")],
                           "--theory computes Eq. 8's curves from --head_dim, --gamma, "
                           "--scale_base and --max_dist alone: --ckpt would be ignored"),
                          (["--theory", "--length", "8", "--bca", "on"],
                           "alone: --length, --bca would be ignored"),
                          (["--ckpt", str(tmp_path / "nope.pt"), "--length", "8"],
                           "no checkpoint at")):
        with pytest.raises(SystemExit) as e:
            resolution.main(argv)
        assert message in str(e.value.code)


def test_r_shared_compares_modes_over_the_same_distances():
    """The same scores, with the distances >= block_size hidden (as BCA hides them) or not: R
    moves, R_shared not."""
    block_size, T = 8, 32
    curve = torch.linspace(1.0, -1.0, T, dtype=torch.float64)  # decreasing with distance
    shown = curve.expand(1, 2, T).clone()  # (layer, head, distance)
    hidden = shown.clone()
    hidden[..., block_size:] = float("-inf")
    a, b = (resolution.layer_average(s) for s in (shown, hidden))
    assert a["R"] != pytest.approx(b["R"], rel=1e-3)  # hiding alone raises R
    a_shared, b_shared = (resolution.layer_average(s[..., :block_size], "_shared")
                          for s in (shown, hidden))
    # Eq. 3 over distances 0 .. block_size-1, by hand
    want = resolution.resolution(curve[:block_size])
    for r in (a_shared, b_shared):
        assert (r["R_shared"] == pytest.approx(want)
                and r["R_shared_per_head"] == pytest.approx(want))


def test_r_shared_in_the_json_and_table(tiny_data, tmp_path, capsys):
    make_checkpoint(tmp_path / "m.pt", tiny_data, block_size=8)
    out = tmp_path / "r.json"
    resolution.main(["--ckpt", str(tmp_path / "m.pt"), "--length", "32", "--bca", "both",
                     "--json", str(out)])
    assert "| R_shared | R_shared (per head) |" in capsys.readouterr().out
    for mode in json.loads(out.read_text())["modes"]:
        # heads averaged, first 8 distances
        by_layer = [resolution.resolution(layer[:8]) for layer in mode["s_hat"]]
        assert mode["R_shared"] == pytest.approx(sum(by_layer) / len(by_layer))
        per_head = [sum(resolution.resolution(h[:8]) for h in layer) / 2
                    for layer in mode["s_hat_heads"]]
        assert mode["R_shared_per_head"] == pytest.approx(sum(per_head) / len(per_head))


def test_bad_values_are_one_line_errors(tiny_data, tmp_path):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    ckpt = str(tmp_path / "m.pt")
    for argv, message in ((["--length", "0"], "--length 0 is not allowed: must be >= 2"),
                          (["--length", "-4"], "--length -4 is not allowed"),
                          (["--length", "8", "--texts", "0"],
                           "--texts 0 is not allowed: must be >= 1"),
                          (["--length", "8", "--texts", "-1"], "--texts -1 is not allowed"),
                          (["--length", "8", "--json", str(tmp_path)], "is a directory"),
                          (["--length", "8", "--device", "bogus"],
                           "device='bogus' is not allowed")):
        with pytest.raises(SystemExit) as e:
            resolution.main(["--ckpt", ckpt, *argv])
        assert message in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        resolution.main(["--theory", "--plot", str(tmp_path)])
    assert "is a directory" in str(e.value.code)


def test_non_finite_scores_are_an_error(tiny_data, tmp_path):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    ckpt = torch.load(tmp_path / "m.pt", weights_only=True)
    ckpt["model"]["transformer.h.0.attn.c_attn.weight"][0, 0] = float("nan")
    # a checkpoint edited by hand is saved with fresh checksums
    save_checkpoint(ckpt, tmp_path / "nan.pt")
    with pytest.raises(SystemExit) as e:
        resolution.main(["--ckpt", str(tmp_path / "nan.pt"), "--length", "16", "--bca", "off"])
    assert "non-finite scores for" in str(e.value.code) and "at length 16" in str(e.value.code)


def test_windows_hide_what_they_hide_and_sinks_count_at_their_true_distance(tiny_data, tmp_path):
    make_checkpoint(tmp_path / "m.pt", tiny_data, block_size=8)
    out = tmp_path / "r.json"
    resolution.main(["--ckpt", str(tmp_path / "m.pt"), "--length", "32",
                     "--attention", "sliding,sinks", "--window", "6", "--sinks", "2",
                     "--json", str(out)])
    sliding, sinks = json.loads(out.read_text())["modes"]
    assert (sliding["label"], sinks["label"]) == ("xpos + sliding W=6", "xpos + sinks S=2 W=6")
    assert sliding["pairs"] == [32 - n for n in range(6)] + [0] * 26  # query t sees t-5 .. t
    # sinks: recent keys at distance 0..3, every query t >= 6 sees keys 0 and 1
    # at distances t and t-1
    t = torch.arange(32)[:, None]
    n = torch.arange(32)[None, :]
    visible = (n <= t) & ((n < 2) | (t - n < 4))
    want = [int(((t - n) == d)[visible].sum()) for d in range(32)]
    assert sinks["pairs"] == want


@pytest.mark.parametrize("argv, message", [
    # 8 TB of table
    (["--max_dist", "1000000000000"], "--max_dist 1000000000000 at --head_dim 64 is too large"),
    (["--head_dim", "100000000", "--max_dist", "10"], "may hold at most 33,554,432"),
    # was NaN rows, exit 0
    (["--gamma", "inf"], "xpos_gamma=inf is not allowed: must be a finite number > 0"),
])
def test_theory_refuses_huge_tables_and_non_finite_values(argv, message):
    with pytest.raises(SystemExit) as e:
        resolution.main(["--theory", *argv])
    assert message in str(e.value.code)



def test_json_and_plot_never_name_one_file(tmp_path):
    """Issue 45 item 7: --theory --json F --plot F wrote the plot over the JSON, status 0."""
    with pytest.raises(SystemExit) as e:
        resolution.main(["--theory", "--head_dim", "16", "--max_dist", "300",
                         "--json", str(tmp_path / "t.png"), "--plot", str(tmp_path / "t.png")])
    assert f"--json and --plot name the same file {tmp_path / 't.png'}" in str(e.value.code)
    assert not (tmp_path / "t.png").exists()


def test_an_explicit_scaling_on_a_fine_tune_is_its_own(tiny_data, tmp_path):
    """Issue 45 items 1 and 13: --rope_scaling yarn --rope_factor 2 on a YaRN fine-tune (s = 2
    from 8) measures the same model as its default, counting over the stored original length."""
    make_checkpoint(tmp_path / "m.pt", tiny_data, pos="rope", block_size=16, rope_scaling="yarn",
                    rope_factor=2.0, rope_original_length=8)
    out = {}
    explicit = ["--rope_scaling", "yarn", "--rope_factor", "2"]
    for name, extra in (("own", []), ("explicit", explicit)):
        resolution.main(["--ckpt", str(tmp_path / "m.pt"), "--length", "32", "--bca", "off",
                         "--json", str(tmp_path / f"{name}.json"), *extra])
        out[name] = json.loads((tmp_path / f"{name}.json").read_text())
    own, explicit = out["own"]["modes"], out["explicit"]["modes"]
    assert [m["rope_original_length"] for m in own] == [8]
    assert [m["rope_original_length"] for m in explicit] == [8]
    assert own[0]["R"] == explicit[0]["R"] and own[0]["s_hat"] == explicit[0]["s_hat"]
