"""Tests for study/control.py: reproduce.py --suite control, the context probe's positive
control (its plan and its table from raw rows written by hand)."""

import json

import numpy as np
import pytest

from study import reproduce


def test_the_control_suite_plans_and_tables_its_probe(tmp_path, capsys):
    """--suite control (the context probe's positive control, issue 46): at l = 64, RoPE at 4l
    probed inside its own length under causal attention, xPos and RoPE at l past it under causal
    and BCA, at every 15th position (every phase of H = 32), with as many tokens an iteration as
    the study; the table is each seed's gain and the 95% t interval over seeds, from raw rows
    written by hand."""
    results, runs = tmp_path / "r", tmp_path / "o"
    reproduce.main(["--suite", "control", "--plan", "--results", str(results), "--runs",
                    str(runs), "--data", str(tmp_path / "d")])
    plan = capsys.readouterr().out
    assert "0 of 18 jobs finished already" in plan
    assert ("--pos=rope --block_size=256 --batch_size=16 --gradient_accumulation_steps=1 "
            "--seed=1339") in plan
    assert ("--pos=rope --block_size=512 --batch_size=8 --gradient_accumulation_steps=1 "
            "--seed=1337 --out_dir=" + str(runs / "long8_s1337")) in plan
    assert ("--pos=xpos --xpos_scale_base=32.0 --block_size=64 --batch_size=64 "
            "--gradient_accumulation_steps=1 --seed=1337") in plan
    assert ("--probe context --attention causal --beyond 64 --lengths 256 --stride 15 "
            "--sequences 512") in plan
    assert ("--probe context --attention causal,bca --beyond 64 --lengths 1024 --stride 15"
            in plan)
    (results / "raw").mkdir(parents=True)
    gains = [0.031, 0.027, 0.035]
    rows = [dict(ckpt=str(runs / f"long_s{seed}" / "ckpt.pt"), pos="rope", label="rope", gain=g,
                 by_bin=[dict(start=64, end=128, gain=g + 0.001)])
            for seed, g in zip((1337, 1338, 1339), gains)]
    rows.append(dict(ckpt=str(tmp_path / "elsewhere.pt"), pos="rope", label="rope", gain=9.0,
                     by_bin=[]))
    (results / "raw" / "long.context.json").write_text(json.dumps({"rows": rows}))
    reproduce.main(["--suite", "control", "--report", "--results", str(results), "--runs",
                    str(runs)])
    assert "elsewhere.pt are left out" in capsys.readouterr().out
    row = json.loads((results / "summary.json").read_text())["table"]["long: rope"]
    mean, sd = np.mean(gains), np.std(gains, ddof=1)
    assert row["gain"]["values"] == gains
    assert row["gain interval"] == pytest.approx([mean - 4.303 * sd / 3**0.5,
                                                  mean + 4.303 * sd / 3**0.5], rel=1e-3)
    assert "(excludes 0)" in (results / "tables.md").read_text()
    # a BCA row's gain against the reference matched to BCA (relay alone), with its interval
    relay = [0.004, -0.002, 0.001]
    rows = [dict(ckpt=str(runs / f"xpos_s{seed}" / "ckpt.pt"), pos="xpos", label="xpos + BCA",
                 gain=0.01, by_bin=[], matched_gain=m,
                 matched_reference="BCA's direct window, from the previous segment's start")
            for seed, m in zip((1337, 1338, 1339), relay)]
    (results / "raw" / "xpos.context.json").write_text(json.dumps({"rows": rows}))
    reproduce.main(["--suite", "control", "--report", "--results", str(results), "--runs",
                    str(runs)])
    row = json.loads((results / "summary.json").read_text())["table"]["xpos: xpos + BCA"]
    mean, sd = np.mean(relay), np.std(relay, ddof=1)
    assert row["matched gain"]["values"] == relay
    assert row["matched gain interval"] == pytest.approx([mean - 4.303 * sd / 3**0.5,
                                                          mean + 4.303 * sd / 3**0.5], rel=1e-3)
    assert ("| xpos: xpos + BCA | BCA's direct window, from the previous segment's start | "
            "0.0010 ± 0.0030 [0.0040 / -0.0020 / 0.0010] | [" in
            (results / "tables.md").read_text())
