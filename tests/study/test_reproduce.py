"""Tests for reproduce.py: the whole study on a toy budget (two schemes, so that it takes a minute
or two), its resumability, the spread over seeds by hand, and its errors."""

import functools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lexgpt.checkpoint import load_checkpoint
from study import files as study_files
from study import jobs as study_jobs
from study import report as study_report
from study import reproduce
from study import tables as study_tables
from study import verdicts as study_verdicts
from study.control import control_markdown

ROOT = Path(__file__).resolve().parents[2]


def study(tmp, *extra):
    argv = [sys.executable, "study/reproduce.py", "--budget", "toy", "--schemes", "learned,rope",
            "--results", str(tmp / "results"), "--runs", str(tmp / "runs"),
            "--data", str(tmp / "data"), *extra]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def toy_study(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("study")
    done = study(tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp, done.stdout


@pytest.mark.slow
def test_toy_study_end_to_end(toy_study):
    tmp, stdout = toy_study
    results = tmp / "results"
    summary = json.loads((results / "summary.json").read_text())
    # the recipe its models were trained with
    recorded = json.loads((results / "recipe.json").read_text())
    assert (recorded["max_iters"] == 2
            and recorded["learning_rate"] == summary["recipe"]["learning_rate"])
    ppl = summary["perplexity"]
    # rope: 3 seeds at every length 4 .. 64 (l = 16), under each window rule and each interpolation
    for name in ("rope", "rope + BCA", "rope + sliding W=16", "rope + sinks S=4 W=16", "rope + pi",
                 "rope + yarn", "rope + dynamic_ntk", "rope + ntk"):
        assert (sorted(ppl[name]) == ["16", "32", "4", "64"]
                and all(c["n"] == 3 for c in ppl[name].values()))
    # each interpolation beside the plain model on the same spans and checkpoints (fewer
    # spans than the ppl rows)
    assert (ppl["rope (2 spans)"]["64"]["n"] == 3
            and summary["panels"]["rope (2 spans)"] == "interpolation")
    assert summary["effective_context"]["rope (2 sequences)"]["gain at d=0"]["n"] == 3
    # learned positions stop at block_size: measured up to l only, with one seed
    assert sorted(ppl["learned"]) == ["16", "4"] and ppl["learned"]["16"]["n"] == 1
    assert summary["resolution"]["rope + BCA"]["R at 2l"]["n"] == 3
    assert "R at 2l" not in summary["resolution"]["learned"]
    # n_layer * l / 2
    assert summary["effective_context"]["rope + BCA"]["reach bound"]["mean"] == 2 * 16 / 2
    assert set(summary["passkey_accuracy"]) == {"rope", "rope + BCA", "rope + sliding W=16",
                                                "rope + sinks S=4 W=16"}
    for name in ("tables.md", "perplexity.png", "effective_context.png", "figure2_theory.png",
                 "figure2_theory_sb512.png", "passkey_rope.png", "timings.json"):
        assert (results / name).stat().st_size > 0
    tables = (results / "tables.md").read_text()
    mean, std = ppl["rope + BCA"]["64"]["mean"], ppl["rope + BCA"]["64"]["std"]
    assert f"{mean:.2f} ± {std:.2f}" in tables
    # the paper's Table 5 beside ours: our row, then the paper's (4 x 1024 tokens: 294.45 for RoPE)
    lines = tables.splitlines()
    ours = lines.index(next(line for line in lines
                            if line.startswith("| rope + BCA (ours, l = 16) |")))
    assert lines[ours + 1] == "| RoPE + BCA (paper, l = 1024) | 25.57 | 25.65 | – | – |"
    at = ppl["rope + BCA"]["32"]
    assert cell_of(lines[ours], 1) == f"{at['mean']:.2f} ± {at['std']:.2f} [" + " / ".join(
        f"{v:.2f}" for v in at["values"]) + "]"
    # is context beyond l used? every rule of rope (learned stops at l), three seeds,
    # each span's gain kept
    context = summary["context"]
    assert set(context) == {"rope", "rope + BCA", "rope + sliding W=16", "rope + sinks S=4 W=16"}
    rows = study_jobs.read_result(results / "raw" / "rope.context.json")["rows"]
    bca = [r for r in rows if r["attention"] == "bca"]
    assert (len(bca) == 3
            and context["rope + BCA"]["gain"]["values"] == pytest.approx([r["gain"] for r in bca]))
    low, high = context["rope + BCA"]["gain interval"]
    assert min(r["gain"] for r in bca) - 1e-9 <= high and low <= max(r["gain"] for r in bca) + 1e-9
    assert ("### Context beyond l" in tables
            and "| rope + BCA | " in tables.split("### Context beyond l")[1])
    wall = summary["wall_time"]
    assert wall["measured"] == wall["jobs"] and wall["seconds"] > 0  # every job of this run timed
    assert "about" in stdout and "left)" in stdout  # progress with the time left


def cell_of(line, i):
    return line.split(" | ")[i].strip(" |")


@pytest.mark.slow
def test_spread_against_the_seeds_rows(toy_study):
    """The table's mean and std are those of the three seeds' own rows in
    eval_extrapolate.py's JSON."""
    tmp, _ = toy_study
    rows = study_jobs.read_result(tmp / "results" / "raw" / "rope.ppl.json")["rows"]
    values = [r["ppl"] for r in rows if r["length"] == 32 and r["attention"] == "sinks"]
    assert len(values) == 3 and len({r["ckpt"] for r in rows}) == 3
    mean = sum(values) / 3
    std = (sum((v - mean) ** 2 for v in values) / 2) ** 0.5
    cell = (json.loads((tmp / "results" / "summary.json").read_text())
            ["perplexity"]["rope + sinks S=4 W=16"]["32"])
    assert cell["mean"] == pytest.approx(mean) and cell["std"] == pytest.approx(std)
    # each seed's own, in the order of its checkpoints
    assert cell["values"] == pytest.approx(values)


@pytest.mark.slow
def test_resumes_only_what_is_missing(toy_study):
    tmp, _ = toy_study
    raw = tmp / "results" / "raw"
    kept = ((raw / "learned.ppl.json").stat().st_mtime_ns,
            (raw / "rope.passkey.json").stat().st_mtime_ns)
    (raw / "learned.repeat.json").unlink()
    # a training run stopped halfway: its checkpoint at iteration 1 of 2, written by
    # the job's own command
    args = reproduce.parse_args(["--budget", "toy", "--schemes", "learned,rope",
                                 "--results", str(tmp / "results"), "--runs", str(tmp / "runs"),
                                 "--data", str(tmp / "data")])
    budget = dict(study_jobs.BUDGETS["toy"], schemes=["learned", "rope"])
    budget["recipe"] = dict(study_jobs.read_recipe(ROOT / "config" / "study_char.py"),
                            **budget["train"])
    job = next(j for j in study_jobs.plan(args, budget) if j.name == "train rope_s1338")
    job.output.unlink()
    subprocess.run([*job.command, "--max_iters=1"], cwd=ROOT, check=True, capture_output=True)
    again = study(tmp)
    assert again.returncode == 0, again.stderr
    ran = [line for line in again.stdout.splitlines() if line.startswith("[")]
    # the missing result, the stopped run, and every result of that run's checkpoint (now
    # newer than they are)
    assert [r.split("] ")[1].split(" (")[0] for r in ran] == [
        "repeat probe learned", "train rope_s1338", "perplexity rope", "interpolation rope",
        "resolution rope_s1338 at 1l", "resolution rope_s1338 at 2l", "repeat probe rope",
        "repeat probe rope, interpolated", "context rope", "tables and plots"]
    # resumed (train.py refuses to start afresh over a checkpoint), to the end; the log is
    # the uninterrupted run's
    assert "--seed=1338" in again.stdout and "--init_from=resume" in again.stdout
    assert load_checkpoint(job.output)["iter_num"] == 2
    log = (tmp / "runs" / "rope_s1338" / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["iter"] for line in log if "val_loss" in line] == [0, 2]
    assert (raw / "learned.repeat.json").exists()
    assert ((raw / "learned.ppl.json").stat().st_mtime_ns,
            (raw / "rope.passkey.json").stat().st_mtime_ns) == kept


@pytest.mark.slow
def test_raw_results_are_stored_compact(toy_study):
    """Each job's JSON as the study keeps it: one row per line, without per-position
    curves, already compact."""
    tmp, _ = toy_study
    raw = tmp / "results" / "raw"
    ppl = (raw / "rope.ppl.json").read_text()
    rows = json.loads(ppl)["rows"]
    assert "curves" not in json.loads(ppl) and len(rows) == 48
    assert ([line.strip(" ,") for line in ppl.splitlines() if '"ppl": ' in line]
            == [json.dumps(r) for r in rows])
    resolution = json.loads((raw / "rope_s1337.resolution1.json").read_text())
    assert all("s_hat" not in mode and "pairs" not in mode and "R_shared" in mode
               for mode in resolution["modes"])
    for path in raw.glob("*.json"):
        text = path.read_text()
        kept = study_files.compact_result(json.loads(text))
        assert study_files.compact_json(kept) + "\n" == text, path.name


def test_compact_raw_keeps_the_time_a_result_is_judged_by(tmp_path):
    path = tmp_path / "x.ppl.json"
    path.write_text(json.dumps({"rows": [{"ppl": 1 / 3, "length": 8}],
                                "curves": [{"mean_nll": [0.5] * 8}]},
                               indent=1))
    os.utime(path, ns=(10**18, 10**18))
    study_files.compact_raw(path)
    assert path.read_text() == '{\n "rows": [\n  {"ppl": 0.3333333333, "length": 8}\n ]\n}\n'
    assert path.stat().st_mtime_ns == 10**18
    path.write_text('{"rows": [')  # cut short
    with pytest.raises(reproduce.UserError, match="x.ppl.json is not JSON"):
        study_files.compact_raw(path)


COMMITTED_RAW = ["retrieval/raw/rope.tasks.json", "retrieval_rerun/raw/xpos_s1337.sweep.json",
                 "char/raw/rope.ppl.json", "char/raw/xpos.context.json", "char/raw/theory.json"]


def json_rows(result):
    """Each row as JSON text: 1.0 and 1, true and 1 told apart, NaN equal to itself."""
    return [json.dumps(row, sort_keys=True) for row in result.get("rows", [])]


@pytest.mark.parametrize("name", COMMITTED_RAW)
def test_compact_raw_files_read_back_as_the_full_json(tmp_path, name):
    """A committed raw file's rows written in full, as the scripts write them (every field in
    every row), then kept compact (each field's value that most rows share written once, in
    row_defaults): read_result gives back the full JSON, every row field by field; compacting
    again changes nothing, and the committed file is that form."""
    committed = ROOT / "results" / name
    full = study_jobs.read_result(committed)
    assert all("ckpt" in row and "label" in row for row in full.get("rows", []))
    (tmp_path / "full.json").write_text(json.dumps(full, indent=1))
    path = tmp_path / "compact.json"
    shutil.copy(tmp_path / "full.json", path)
    study_files.compact_raw(path)
    text = path.read_text()
    assert text == committed.read_text()
    assert ("row_defaults" in text) == ("rows" in full)
    expected = json.loads((tmp_path / "full.json").read_text())
    assert study_jobs.read_result(path) == expected
    assert json_rows(study_jobs.read_result(path)) == json_rows(expected)
    os.utime(path, ns=(10**18, 10**18))
    study_files.compact_raw(path)
    assert path.read_text() == text and path.stat().st_mtime_ns == 10**18


def test_compact_raw_keeps_each_rows_own_value_and_type(tmp_path):
    """A row's value that JSON tells apart from the shared one (1.0 or 1 from true, NaN from
    null) is kept in the row; a field some rows lack stays in the rows that have it; one row
    alone is left as it is."""
    shared = {"pos": "rope", "label": "r"}
    rows = [{"ckpt": "a", "x": 1, "flag": True, "v": None, **shared},
            {"ckpt": "a", "x": 1.0, "flag": 1, "v": None, "extra": [1, 2], **shared},
            {"ckpt": "b", "x": 1, "flag": True, "v": float("nan"), **shared}]
    path = tmp_path / "x.ppl.json"
    path.write_text(json.dumps({"probe": "p", "rows": rows, "skipped": []}))
    study_files.compact_raw(path)
    compact = json.loads(path.read_text())
    assert list(compact) == ["probe", "row_defaults", "rows", "skipped"]
    assert compact["row_defaults"] == dict(ckpt="a", flag=True, v=None, x=1, **shared)
    own = '[{}, {"x": 1.0, "flag": 1, "extra": [1, 2]}, {"ckpt": "b", "v": NaN}]'
    assert json.dumps(compact["rows"]) == own
    assert json_rows(study_jobs.read_result(path)) == json_rows({"rows": rows})
    one = {"rows": [{"ckpt": "a", **shared}]}
    assert study_files.compact_result(one) == one


def flat_numbers(value, key=""):
    """{path: leaf} of a JSON value."""
    if isinstance(value, dict):
        return {k: v for name, item in value.items()
                for k, v in flat_numbers(item, f"{key}/{name}").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value)
                for k, v in flat_numbers(item, f"{key}[{i}]").items()}
    return {key: value}


@pytest.mark.slow
@pytest.mark.parametrize("suite", ["char", "retrieval", "retrieval_lr3e-3", "retrieval_rerun",
                                   "extension"])
def test_committed_raw_results_reproduce_the_committed_tables(tmp_path, suite):
    """--report from the committed results (the study's results/char, the task suite's
    results/retrieval, its first run at 3e-3 and its rerun for the sweep (the schemes its summary
    names), the context extension's results/extension with its task rows) alone
    (raw/, timings.json, recipe.json) draws the committed tables.md exactly, a summary.json whose
    every number agrees with the committed one, and leaves the raw files as they are."""
    committed = ROOT / "results" / suite
    shutil.copytree(committed, tmp_path / suite)
    runs = {"retrieval_lr3e-3": "out/retrieval_lr3e-3", "retrieval_rerun": "out/retrieval_rerun"}
    reproduce.main(["--report", "--results", str(tmp_path / suite)]
                   + (["--suite", "retrieval"] if suite.startswith("retrieval") else [])
                   + (["--suite", "extension"] if suite == "extension" else [])
                   + (["--runs", runs[suite]] if suite in runs else []))
    assert (tmp_path / suite / "tables.md").read_text() == (committed / "tables.md").read_text()
    drawn, kept = (flat_numbers(json.loads((d / "summary.json").read_text()))
                   for d in (tmp_path / suite, committed))
    assert drawn.keys() == kept.keys()
    for key, value in kept.items():
        if isinstance(value, float):
            assert drawn[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
        else:
            assert drawn[key] == value, key
    for path in sorted((committed / "raw").glob("*.json")):
        assert ((tmp_path / suite / "raw" / path.name).read_bytes()
                == path.read_bytes()), f"{path.name} not compact"


@pytest.mark.slow
def test_rows_of_another_results_directory_are_left_out(tmp_path, capsys):
    """A raw file's rows measured on checkpoints outside --runs (a file copied from another results
    directory), or on a checkpoint under --runs trained at another block_size, are left out with a
    note, not averaged in as more seeds (issue 33, finding 7): the tables come out as
    the committed ones."""
    import torch
    committed = ROOT / "results" / "retrieval"
    shutil.copytree(committed, tmp_path / "r")
    path = tmp_path / "r" / "raw" / "alibi.tasks.json"
    result = study_jobs.read_result(path)  # every row in full
    foreign = [dict(row, ckpt=row["ckpt"].replace("out/retrieval/", "out/retrieval96/"),
                    accuracy=0.0)
               for row in result["rows"]]
    runs = tmp_path / "runs"
    retrained = [dict(row, ckpt=str(runs / "alibi_passkey" / "ckpt.pt"), accuracy=0.0)
                 for row in result["rows"]]
    (runs / "alibi_passkey").mkdir(parents=True)
    torch.save({"model": {}, "model_args": {}, "config": {"data_dir": "d", "block_size": 96}},
               runs / "alibi_passkey" / "ckpt.pt")
    (runs / "alibi_s1339").mkdir()
    torch.save({"model": {}, "model_args": {}, "config": {"data_dir": "d", "block_size": 128}},
               runs / "alibi_s1339" / "ckpt.pt")
    for other in (tmp_path / "r" / "raw").glob("*.json"):  # measured on checkpoints under runs
        other.write_text(other.read_text().replace('"out/retrieval/', f'"{runs}/'))
    own = study_jobs.read_result(path)["rows"]
    path.write_text(json.dumps(dict(result, rows=own + foreign + retrained)))
    reproduce.main(["--report", "--suite", "retrieval", "--results", str(tmp_path / "r"),
                    "--runs", str(runs)])
    out = capsys.readouterr().out
    assert (f"rows of {runs / 'alibi_passkey' / 'ckpt.pt'} are left out of the tables: trained at "
            "block_size 96, not the results' 128" in out)
    assert ("rows of out/retrieval96/alibi_s1337/ckpt.pt are left out of the tables: not one of"
            in out)
    # noted once, however many tables read it
    assert out.count("out/retrieval96/alibi_s1337/ckpt.pt") == 1
    alibi = [line for line in (tmp_path / "r" / "tables.md").read_text().splitlines()
             if line.startswith("| alibi")]
    assert alibi == [line for line in (committed / "tables.md").read_text().splitlines()
                     if line.startswith("| alibi")]


def test_spread():
    assert study_report.spread([1.0, 2.0, 4.0]) == {"mean": pytest.approx(7 / 3),
                                                    "std": pytest.approx(1.5275252),
                                                 "n": 3, "of": 3, "values": [1.0, 2.0, 4.0]}
    assert study_report.spread([2.0]) == {"mean": 2.0, "std": None, "n": 1, "of": 1,
                                          "values": [2.0]}
    assert study_report.spread([None, 3.0]) == {"mean": 3.0, "std": None, "n": 1, "of": 2,
                                                "values": [3.0]}
    assert study_report.spread([None]) is None


def test_cell_says_how_many_checkpoints_a_partial_value_rests_on():
    assert (study_tables.cell(study_report.spread([1.0, 2.0, 4.0]))
            == "2.33 ± 1.53 [1.00 / 2.00 / 4.00]")
    assert study_tables.cell(study_report.spread([None, 64.0, None]), 0) == "64 (1 of 3)"
    assert (study_tables.cell(study_report.spread([None, 16.0, 48.0]), 0)
            == "32 ± 23 [16 / 48] (2 of 3)")
    assert study_tables.cell(None) == "–"


@pytest.mark.parametrize("argv, message", [
    (["--schemes", "rope,posfree"],
     "--schemes rope,posfree: unknown posfree; the study's schemes are learned"),
    (["--budget", "huge"], "invalid choice: 'huge'"),
])
@pytest.mark.slow
def test_errors(tmp_path, argv, message):
    done = study(tmp_path, *argv)
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_failed_job_stops_with_one_line_and_keeps_the_rest(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text("{}")  # a dataset that train.py refuses
    done = study(tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("reproduce.py: error: train "
                                                           "learned_s1337 failed (exit 1)")
    assert (tmp_path / "data" / "meta.json").read_text() == "{}"


@pytest.mark.slow
def test_tune_reports_the_last_validation_loss_of_each_run(tmp_path):
    done = study(tmp_path, "--tune")
    assert done.returncode == 0, done.stderr[-3000:]
    tuning = json.loads((tmp_path / "results" / "tuning.json").read_text())
    lr = tuning["recipe"]["learning_rate"]
    assert set(tuning["val_loss"]) == set(study_jobs.TUNE_SCHEMES)
    for scheme, row in tuning["val_loss"].items():
        assert list(row) == [f"{lr * f:g}" for f in study_jobs.TUNE_FACTORS]
        # the recipe's own learning rate is the study's first-seed run: its log's last evaluation
        log = tmp_path / "runs" / f"{scheme}_s1337" / "log.jsonl"
        last = [json.loads(line) for line in log.read_text().splitlines() if "val_loss" in line][-1]
        assert row[f"{lr:g}"] == last["val_loss"]
    assert "| rope |" in done.stdout


def readme_results_section():
    """The README's headline results: from its "Results at small scale" heading to
    the next heading."""
    text = (ROOT / "README.md").read_text()
    start = text.index("## Results at small scale")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


# docs/results.md: the study above it, the task suite from it on
SUITE_HEADING = "\n## The long-range task suite"
CONTROL_HEADING = "\n## The context probe's positive control"
# and from here on, the context extension
EXTENSION_HEADING = "\n## Context extension by fine-tuning"


def test_results_pages_match_the_committed_summary():
    """Every table row and every decimal number of the full results page (docs/results.md) and of
    the README's headline results is in the tables drawn from the committed summary.json: the
    study's part from results/char's (which also carry the paper's numbers beside ours), the task
    suite's part from results/retrieval's, the context extension's from results/extension's."""
    import re
    # a result; not a setting in scientific notation (1.5e-3)
    number = r"(?<![\d.])\d+\.\d+(?![\d.]|e-?\d)"
    page = (ROOT / "docs" / "results.md").read_text()
    study, suite = page.split(SUITE_HEADING)
    suite, extension = suite.split(EXTENSION_HEADING)
    study, control = study.split(CONTROL_HEADING)
    control, rest = control.split("\n## ", 1)
    study += rest
    sources = {"char": study_tables.tables_markdown, "retrieval": study_tables.retrieval_markdown,
               "extension": study_tables.extension_markdown, "control": control_markdown}
    checks = [("char", "docs/results.md (the study)", study, 20),
              ("char", "README.md", readme_results_section(), 5),
              ("control", "docs/results.md (the positive control)", control, 4),
              ("retrieval", "docs/results.md (the task suite)", suite, 4),
              ("extension", "docs/results.md (the context extension)", extension, 10)]
    for results, page, section, least in checks:
        summary = json.loads((ROOT / "results" / results / "summary.json").read_text())
        tables = sources[results](summary)
        # the committed tables are current
        assert tables == (ROOT / "results" / results / "tables.md").read_text()
        cells = set(re.findall(number, tables))
        rows = [line for line in section.splitlines() if line.startswith("| ")
                and not line.startswith("| model")]
        assert len(rows) >= least, f"{page} shows too few rows of the tables"
        for line in rows:
            assert line in tables.splitlines(), (
                f"{page} row not in the tables drawn from summary.json: {line}")
        # a verdict's sentence is computed from the results, its numbers with it
        # (tests/study/test_verdicts.py): the rest of the prose is checked here
        for value in re.findall(number, study_verdicts.MARK.sub(" ", section)):
            assert value in cells, (
                f"{page} number {value} is not in results/{results}/summary.json's tables")


@pytest.mark.parametrize("results, message", [
    ("/etc/hostname",
     "--results /etc/hostname/raw: it (or a folder above it) is a file, not a directory"),
    # root writes anywhere else
    ("/proc/lex-gpt-results", "--results /proc/lex-gpt-results/raw is not writable"),
])
def test_results_that_cannot_be_written_are_one_line(tmp_path, results, message):
    with pytest.raises(SystemExit) as e:
        reproduce.main(["--budget", "toy", "--schemes", "learned", "--results", results,
                        "--runs", str(tmp_path), "--data", str(tmp_path / "data"), "--plan"])
    assert (e.value.code == f"reproduce.py: error: {message}" if "hostname" in results
            else message in e.value.code)


def test_a_damaged_result_counts_as_missing(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"")
    output = tmp_path / "raw" / "rope.ppl.json"
    output.parent.mkdir()
    job = study_jobs.Job("perplexity rope", "extrapolate", output, inputs=[ckpt])
    for damaged in ("{", "[]", '{"rows": 3}', '{"rows": [{"x": 1}]}'):
        output.write_text(damaged)  # newer than its checkpoint
        assert not job.done() and study_jobs.read_result(output) is None
    output.write_text(json.dumps({"rows": [{"ckpt": "c", "pos": "rope", "label": "rope"}]}))
    assert job.done()


@pytest.mark.slow
def test_report_leaves_a_damaged_result_out_and_a_damaged_timings_file_is_a_note(tmp_path, capsys):
    shutil.copytree(ROOT / "results" / "char", tmp_path / "char")
    (tmp_path / "char" / "raw" / "rope.ppl.json").write_text('{"rows": [')  # cut short
    (tmp_path / "char" / "timings.json").write_text("{not json")
    reproduce.main(["--report", "--results", str(tmp_path / "char")])
    out = capsys.readouterr().out
    assert ("rope.ppl.json is damaged, left out of the tables" in out
            and "timings.json is not readable JSON" in out)
    summary = json.loads((tmp_path / "char" / "summary.json").read_text())
    assert "rope" not in summary["perplexity"] and "alibi" in summary["perplexity"]
    assert study_jobs.read_timings(tmp_path / "char" / "timings.json") == {}
    # the right keys with a value that is no number: that row left out with a note, the
    # rest of its file kept
    raw = tmp_path / "char" / "raw" / "alibi.ppl.json"
    result = study_jobs.read_result(raw)
    result["rows"][0]["ppl"] = "x"
    raw.write_text(json.dumps(result))
    reproduce.main(["--report", "--results", str(tmp_path / "char")])
    assert "is 'x', not a number: left out of the tables" in capsys.readouterr().out
    kept = json.loads((tmp_path / "char" / "summary.json").read_text())["perplexity"]["alibi"]
    row = result["rows"][0]
    assert kept[str(row["length"])]["n"] == 2 and kept[str(result["rows"][1]["length"])]["n"] == 3


@pytest.mark.slow
def test_a_damaged_result_newer_than_its_checkpoints_is_measured_again(toy_study):
    tmp, _ = toy_study
    raw = tmp / "results" / "raw"
    (raw / "learned.repeat.json").write_text("{ damaged")
    (tmp / "results" / "timings.json").write_text("[")
    again = study(tmp)
    assert again.returncode == 0, again.stderr
    ran = [line.split("] ")[1].split(" (")[0] for line in again.stdout.splitlines()
           if line.startswith("[")]
    assert (ran == ["repeat probe learned", "tables and plots"]
            and "timings.json is not readable JSON" in again.stdout)
    assert study_jobs.read_result(raw / "learned.repeat.json")["rows"]

def one_job_study(tmp, job):
    """reproduce.run_jobs on one job, with the arguments it reads."""
    from types import SimpleNamespace
    args = SimpleNamespace(results=str(tmp / "results"), plan=False, budget="toy", verbose=False)
    (tmp / "results").mkdir(exist_ok=True)
    reproduce.run_jobs(args, {"recipe": {"max_iters": 2}}, [job])


def test_a_train_job_whose_run_is_owned_is_not_started(tmp_path):
    """A run directory that another process owns (a train.py left running, or another study) is a
    one-line error naming it, and the job is never started."""
    import fcntl
    out = tmp_path / "runs" / "rope_s1337"
    out.mkdir(parents=True)
    fd = os.open(out / "lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, b"pid 4242 on host elsewhere (train.py)\n")
    marker = tmp_path / "started"
    job = study_jobs.Job("train rope_s1337", "train", out / "ckpt.pt",
                        [sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    try:
        with pytest.raises(reproduce.UserError) as e:
            one_job_study(tmp_path, job)
    finally:
        os.close(fd)
    assert str(e.value).startswith(f"train rope_s1337: its run directory {out} is in use by pid "
                                   "4242 on host elsewhere (train.py)")
    assert not marker.exists()
    one_job_study(tmp_path, job)  # once the owner is gone
    assert marker.exists()


@pytest.mark.slow
def test_a_job_dies_with_reproduce(tmp_path):
    """kill -9 of reproduce.py alone left its train.py running, orphaned, beside the study run
    again: a job now dies with reproduce.py."""
    pid_file = tmp_path / "job.pid"
    job = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", f"""
import sys; sys.path[:0] = [{str(ROOT)!r}, {str(Path(__file__).parent)!r}]
from pathlib import Path
import test_reproduce
from study import jobs
test_reproduce.one_job_study(Path({str(tmp_path)!r}), jobs.Job("job", "extrapolate", \
Path({str(tmp_path)!r}) /
                             "out.json", [sys.executable, "-c", {job!r}]))
"""], cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        while parent.poll() is None and not (pid_file.exists() and pid_file.read_text()):
            time.sleep(0.01)
        assert parent.poll() is None, "reproduce ended before its job started"
        parent.kill()
    finally:
        parent.wait()
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 30  # not a timing check: the job would sleep for 60 seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid), "the job outlived reproduce.py"


def alive(pid):
    """Whether pid runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_checkpoint_trained_with_another_recipe_is_neither_finished_nor_resumed(tmp_path):
    argv = ["--suite", "retrieval", "--budget", "toy", "--schemes", "rope",
            "--results", str(tmp_path / "results"), "--runs", str(tmp_path / "runs"),
            "--data", str(tmp_path / "data")]
    budget = dict(study_jobs.RETRIEVAL_BUDGETS["toy"], schemes=["rope"])
    budget["recipe"] = dict(study_jobs.read_recipe(ROOT / study_jobs.RETRIEVAL_CONFIG),
                            **budget["train"])
    job = next(j for j in study_jobs.retrieval_plan(reproduce.parse_args(argv), budget)
               if j.name == "train rope_s1337")
    assert (job.settings["learning_rate"] == budget["recipe"]["learning_rate"]
            and job.settings["pos"] == "rope")
    job.output.parent.mkdir(parents=True)

    def trained(iters, **changed):  # a checkpoint as train.py writes it, from these settings
        config = dict(job.settings, **changed)
        torch.save({"model": {}, "model_args": {"pos": config["pos"]}, "config": config,
                    "iter_num": iters},
                   job.output)

    # where and on what: not the recipe
    trained(2, out_dir="/elsewhere", device="cuda", data_dir="/moved")
    assert job.done(max_iters=2)
    # stopped early, as by --max_iters: it resumes, the same run
    trained(1, max_iters=1, eval_interval=1)
    assert not job.done(max_iters=2)
    trained(3, max_iters=3)  # trained past this job's end: other weights
    with pytest.raises(reproduce.UserError,
                       match=r"rope_s1337: .* was trained to iteration 3, past this recipe's "
                                                  r"max_iters=2; move "):
        job.done(max_iters=2)
    lr = job.settings["learning_rate"]
    # finished, or stopped part way (resuming would mix two recipes in one run)
    for iters in (2, 1):
        trained(iters, learning_rate=2 * lr, seed=1)
        with pytest.raises(reproduce.UserError) as e:
            job.done(max_iters=2)
        assert str(e.value) == (f"train rope_s1337: {job.output} was trained with "
                                f"learning_rate={2 * lr}, seed=1, not this recipe's "
                                f"learning_rate={lr}, seed=1337; move {job.output.parent} aside "
                                "(or give another --runs) to train it again")
    with pytest.raises(SystemExit) as e:
        reproduce.main(argv + ["--plan"])
    assert (e.value.code.startswith("reproduce.py: error: train rope_s1337: ")
            and "\n" not in e.value.code)


@pytest.mark.parametrize("suite, budget", [("study", "full"), ("study", "toy"),
                                           ("retrieval", "full"), ("retrieval", "toy"),
                                           ("tune", "full"), ("extension", "full"),
                                           ("extension", "toy")])
def test_each_training_job_names_its_settings_as_train_py_reads_them(tmp_path, suite, budget):
    """The settings the recipe guard compares with a checkpoint's config are what train.py makes of
    the job's own command line (its config file and overrides) and stores in that config: else every
    finished run would be refused, or a mixed one accepted."""
    import train
    argv = ["--budget", budget, "--runs", str(tmp_path / "runs"),
            "--results", str(tmp_path / "results")]
    argv += {"study": [], "retrieval": ["--suite", "retrieval"], "tune": ["--tune"],
             "extension": ["--suite", "extension"]}[suite]
    args = reproduce.parse_args(argv)
    jobs = [job for job in reproduce.jobs_for(args, reproduce.budget_for(args))
            if job.kind == "train"]
    assert len(jobs) >= 3
    for job in jobs:
        config = train.load_config(job.command[2:])
        for key, value in job.settings.items():
            got = getattr(config, key)
            assert got == value and type(got) is type(value), (job.name, key, got, value)


def test_a_results_directory_holds_one_recipe(tmp_path, capsys):
    argv = ["--suite", "retrieval", "--budget", "toy", "--results", str(tmp_path / "results"),
            "--runs", str(tmp_path / "runs"), "--data", str(tmp_path / "data")]
    recipe = dict(study_jobs.read_recipe(ROOT / study_jobs.RETRIEVAL_CONFIG),
                  **study_jobs.RETRIEVAL_BUDGETS["toy"]["train"])
    reproduce.main(argv + ["--plan"])
    assert not (tmp_path / "results" / "recipe.json").exists()  # --plan writes nothing
    # the device does not count
    other = dict(recipe, learning_rate=2 * recipe["learning_rate"], device="cuda")
    (tmp_path / "results").mkdir(exist_ok=True)
    (tmp_path / "results" / "recipe.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit) as e:
        reproduce.main(argv + ["--plan"])
    assert e.value.code == (f"reproduce.py: error: --results {tmp_path / 'results'} holds results "
                            f"trained with learning_rate={2 * recipe['learning_rate']}, not this "
                            f"recipe's learning_rate={recipe['learning_rate']}: give another "
                            "--results")
    # the same models trained longer: other models
    longer = dict(recipe, max_iters=2 * recipe["max_iters"])
    (tmp_path / "results" / "recipe.json").write_text(json.dumps(longer))
    with pytest.raises(SystemExit) as e:
        reproduce.main(argv + ["--plan"])
    assert (f"holds results trained with max_iters={2 * recipe['max_iters']}, not this recipe's "
            f"max_iters={recipe['max_iters']}" in e.value.code)
    (tmp_path / "results" / "recipe.json").write_text(json.dumps(other))
    args = reproduce.parse_args(argv + ["--report"])
    # drawn with the recipe that trained them
    assert reproduce.results_recipe(args, recipe) == other
    for damaged in ("[", "{}", json.dumps({"block_size": 16}), json.dumps(dict(other, n_layer=[2])),
                    json.dumps(dict(other, block_size=0)), json.dumps(dict(other, block_size="96")),
                    json.dumps(dict(other, n_head=0)), json.dumps(dict(other, block_size=17)),
                    json.dumps(dict(other, learning_rate=-1))):
        (tmp_path / "results" / "recipe.json").write_text(damaged)
        with pytest.raises(SystemExit) as e:
            reproduce.main(argv + ["--report"])
        assert (e.value.code.startswith("reproduce.py: error: ")
                and "recipe.json is damaged" in e.value.code)
    # a directory from before recipe.json: its summary's recipe is the recorded one, and
    # a run writes it down
    (tmp_path / "results" / "recipe.json").unlink()
    (tmp_path / "results" / "summary.json").write_text(json.dumps({"recipe": other}))
    with pytest.raises(SystemExit) as e:
        reproduce.main(argv)
    assert "holds results trained with learning_rate=" in e.value.code
    (tmp_path / "results" / "summary.json").write_text("{")  # damaged: redrawn, and binds nothing
    assert reproduce.results_recipe(reproduce.parse_args(argv + ["--plan"]), recipe) == recipe
    (tmp_path / "results" / "summary.json").write_text(
        json.dumps({"recipe": dict(recipe, device="cuda")}))
    args = reproduce.parse_args(argv)
    assert reproduce.results_recipe(args, recipe) == recipe
    assert (json.loads((tmp_path / "results" / "recipe.json").read_text())["learning_rate"]
            == recipe["learning_rate"])


def test_mqar_by_query_is_each_checkpoints_mean_at_1x_under_causal_attention(tmp_path):
    (tmp_path / "raw").mkdir()

    def row(run, label, d, length, by_query, task="mqar", kind="distance"):
        return dict(ckpt=f"out/{run}/ckpt.pt", pos="xpos", label=label, task=task, kind=kind, d=d,
                    length=length, by_query=by_query)

    rows = [row("xpos_sb512_s1337", "xpos", 32, 60, [0.2, 0.4]),
            row("xpos_sb512_s1337", "xpos", 64, 129, [0.4, 0.8]),
            row("xpos_sb512_s1338", "xpos", 32, 60, [1.0, 1.0]),
            # longer than a training record: past 1 x
            row("xpos_sb512_s1337", "xpos", 96, 130, [0.0, 0.0]),
            row("xpos_sb512_s1337", "xpos + BCA", 32, 60, [0.0, 0.0]),  # another rule
            row("xpos_sb512_s1337", "xpos", 32, 60, [0.0, 0.0], task="copy"),
            row("xpos_sb512_s1337", "xpos", 64, 128, [0.0, 0.0], kind="length")]
    (tmp_path / "raw" / "xpos_sb512.tasks.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "raw" / "rope.tasks.json").write_text("{")  # damaged: left out
    found = study_report.mqar_by_query(reproduce.parse_args(["--results", str(tmp_path),
                                                             "--runs", "out"]), 128)
    assert found == {"xpos_sb512_s1337": pytest.approx([0.3, 0.6]), "xpos_sb512_s1338": [1.0, 1.0]}
    tables = study_tables.retrieval_markdown({
        "recipe": {"block_size": 128}, "wall_time": {"seconds": 60, "measured": 1, "jobs": 1},
        "budget": "toy", "seeds": [1], "machine": "m", "tasks": [], "reach": {}, "accuracy": {},
        "mqar_by_query": found})
    assert "| picking among the values not yet asked for | 0.50 | 1.00 |" in tables
    assert "| xpos_sb512_s1337 | 0.30 | 0.60 |" in tables


def test_a_result_whose_checkpoint_is_missing_is_measured_again(tmp_path):
    ckpt, output = tmp_path / "ckpt.pt", tmp_path / "rope.tasks.json"
    output.write_text(json.dumps({"rows": [{"ckpt": str(ckpt), "pos": "rope", "label": "rope"}]}))
    job = study_jobs.Job("tasks rope", "tasks", output, inputs=[ckpt])
    assert not job.done()  # this run trains the checkpoint: the result it has is of another one
    ckpt.write_bytes(b"")
    os.utime(output)  # the result newer than its checkpoint
    assert job.done()


@functools.lru_cache
def t_quantile(df, p=0.975, steps=2000):
    """Student's t quantile by brute force: the density integrated with Simpson's rule from 0,
    the bound found by bisection (no table, no scipy)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(t):
        h = t / steps
        ys = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(steps + 1)]
        return 0.5 + h / 3 * (ys[0] + ys[-1] + 4 * sum(ys[1:-1:2]) + 2 * sum(ys[2:-1:2]))

    low, high = 0.0, 20.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


def test_t_quantiles_against_brute_force_and_the_published_table():
    # one degree of freedom is Cauchy's: tan(pi (p - 1/2)); the published 12.706, 4.303, 3.182
    assert t_quantile(1) == pytest.approx(math.tan(math.pi * 0.475), abs=1e-3)
    assert [round(t_quantile(df), 3) for df in (1, 2, 3)] == [12.706, 4.303, 3.182]
    for n, t in study_report.T_975.items():  # n values: n - 1 degrees of freedom
        assert t == pytest.approx(t_quantile(n - 1), abs=6e-4), n


def test_area_and_t_interval_by_hand():
    # the trapezoids over log2 distance, divided by the width: x = 1, 2, 4 -> (1 + 1)/2 * 1 +
    # (1 + 0)/2 * 2 = 2 of 3
    assert study_report.area([(2, 1.0), (4, 1.0), (16, 0.0)]) == pytest.approx(2 / 3)
    assert study_report.area([(1, 0.25), (4, 0.75)]) == pytest.approx(0.5)
    # Student's t at n - 1 degrees of freedom: 2 ± t(2) / sqrt(3) for three values
    assert (study_report.t_interval([1.0, 2.0, 3.0])
            == pytest.approx([2 - t_quantile(2) / 3**0.5, 2 + t_quantile(2) / 3**0.5], abs=1e-4))
    # two values 0 and 1: std 1/sqrt(2), so 1/2 ± t(1) / 2
    assert (study_report.t_interval([0.0, 1.0])
            == pytest.approx([0.5 - t_quantile(1) / 2, 0.5 + t_quantile(1) / 2], abs=1e-4))
    assert study_report.t_interval([1.0]) is None


def test_the_committed_intervals_are_t_intervals_over_seeds():
    """Every interval the committed summaries publish (the context probe's gain, the task
    suite's areas, paired and between schemes) is the t interval of its seeds' values."""
    def t_of(values):
        n = len(values)
        half = t_quantile(n - 1) * float(np.std(values, ddof=1)) / n ** 0.5
        return pytest.approx([np.mean(values) - half, np.mean(values) + half], abs=1e-4 * half)

    found = 0
    char = json.loads((ROOT / "results" / "char" / "summary.json").read_text())
    for row in char["context"].values():
        values = row["gain"]["values"]
        want = t_of(values) if len(values) > 1 else None
        assert row["gain interval"] == want
        found += len(values) > 1
    suite = json.loads((ROOT / "results" / "retrieval" / "summary.json").read_text())
    for name, row in suite["area"].items():
        for key, value in row.items():
            if " − " in name:
                values, interval = value["values"], value["interval"]
            elif key.endswith("interval"):
                values, interval = row[key[:-len(" interval")]]["values"], value
            else:
                continue
            want = t_of(values) if len(values) > 1 else None
            assert interval == want, (name, key)
            found += len(values) > 1
    assert found > 100


def test_a_report_writes_over_nothing_it_did_not_write(tmp_path):
    """--report refuses, with one line and before writing anything: the other suite's results
    directory, a tables.md or plot it did not write, a summary.json that is a directory."""
    shutil.copytree(ROOT / "results" / "char", tmp_path / "c")
    before = (tmp_path / "c" / "summary.json").read_bytes()
    for argv, message in ((["--suite", "retrieval"],
                           "holds the study's results (raw/): drop --suite retrieval"),
                          ([], None)):
        if message is None:  # a foreign tables.md, then a plot
            (tmp_path / "c" / "tables.md").write_text("my notes\n")
            message = "tables.md exists and is not one a report of reproduce.py wrote"
        with pytest.raises(SystemExit) as e:
            reproduce.main(["--report", "--results", str(tmp_path / "c"), *argv])
        assert message in str(e.value.code) and "\n" not in str(e.value.code)
        assert (tmp_path / "c" / "summary.json").read_bytes() == before
    assert (tmp_path / "c" / "tables.md").read_text() == "my notes\n"
    shutil.copytree(ROOT / "results" / "retrieval", tmp_path / "r",
                    ignore=shutil.ignore_patterns("*.png"))
    (tmp_path / "r" / "copy.png").write_text("not a plot")
    with pytest.raises(SystemExit) as e:
        reproduce.main(["--report", "--results", str(tmp_path / "r")])
    assert "holds the task suite's results (raw/): give --suite retrieval" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        reproduce.main(["--report", "--suite", "retrieval", "--results", str(tmp_path / "r")])
    assert "copy.png exists and is not one a report of reproduce.py wrote" in str(e.value.code)
    (tmp_path / "r" / "copy.png").unlink()
    (tmp_path / "r" / "summary.json").unlink()
    (tmp_path / "r" / "summary.json").mkdir()
    with pytest.raises(SystemExit) as e:
        reproduce.main(["--report", "--suite", "retrieval", "--results", str(tmp_path / "r")])
    assert "summary.json exists and is not one a report of reproduce.py wrote" in str(e.value.code)
    assert not (tmp_path / "r" / "summary.json.partial").exists()


def test_plan_creates_nothing(tmp_path, capsys):
    reproduce.main(["--plan", "--budget", "toy", "--results", str(tmp_path / "r"),
                    "--runs", str(tmp_path / "o"), "--data", str(tmp_path / "d")])
    assert "jobs finished already" in capsys.readouterr().out and not any(tmp_path.iterdir())


def test_the_extension_table_is_each_seeds_rows(tmp_path, capsys):
    """--suite extension's table from raw rows written by hand: per model and rule, each seed's
    perplexity at each length and context gain, mean and sample std over seeds, the fine-tunes'
    extra tokens (50 x 8 x 512); a row of a checkpoint that is not the suite's is
    left out with a note."""
    runs, raw = tmp_path / "runs", tmp_path / "results" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    ppl = {seed: rng.uniform(4, 9, 4) for seed in (1337, 1338, 1339)}
    gain = {seed: rng.uniform(-0.01, 0.01) for seed in (1337, 1338, 1339)}

    def row(ckpt, **kw):
        return dict(ckpt=str(ckpt), pos="rope", label="rope + pi s=4", attention="causal", **kw)

    def ckpt(seed):
        return runs / "extension" / f"rope_pi_s{seed}" / "ckpt.pt"

    rows = [row(ckpt(seed), length=n, ppl=float(ppl[seed][i])) for seed in ppl
            for i, n in enumerate((128, 512, 1024, 2048))]
    rows.append(row(tmp_path / "elsewhere.pt", length=512, ppl=1000.0))
    (raw / "rope_pi.ppl.json").write_text(json.dumps({"rows": rows}))
    (raw / "rope_pi.context.json").write_text(
        json.dumps({"rows": [row(ckpt(s), gain=gain[s]) for s in gain]}))
    reproduce.main(["--suite", "extension", "--report", "--results", str(tmp_path / "results"),
                    "--runs", str(runs)])
    assert "elsewhere.pt are left out" in capsys.readouterr().out
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    table = summary["table"]["fine-tuned at 4l: rope + pi s=4"]
    for i, n in enumerate((128, 512, 1024, 2048)):
        values = [ppl[seed][i] for seed in (1337, 1338, 1339)]
        assert table[str(n)]["mean"] == pytest.approx(np.mean(values))
        assert table[str(n)]["std"] == pytest.approx(np.std(values, ddof=1))
        assert table[str(n)]["values"] == pytest.approx(values)
    assert table["context gain"]["values"] == pytest.approx([gain[s] for s in (1337, 1338, 1339)])
    assert table["extra tokens"]["mean"] == summary["extra_tokens"] == 50 * 8 * 512
    tables = (tmp_path / "results" / "tables.md").read_text()
    assert tables == study_tables.extension_markdown(summary)
    line = next(x for x in tables.splitlines()
                if x.startswith("| fine-tuned at 4l: rope + pi s=4 |"))
    assert "| 204,800 |" in line and f"{np.mean([ppl[s][1] for s in ppl]):.3f} ± " in line


def test_the_extension_task_table_is_accuracy_within_and_past_4l(tmp_path):
    """The extension's task-suite table from raw rows written by hand: each model's mean accuracy
    over the task probe's distances up to 4l and past it, per task; the zero-shot rows are the task
    suite's sources', of its first seed's checkpoint and the labels asked for (another seed's rows
    and another rule's are left out), from the results directory alone (issue 45 item 11: they
    came from --task_results, results/retrieval by default)."""
    l = 128
    task_runs, results = tmp_path / "task_runs", tmp_path / "results"
    (results / "raw").mkdir(parents=True)
    rng = np.random.default_rng(1)
    distances = [32, 256, 512, 768, 2048]

    def rows(ckpt, label, task):
        acc = {d: float(rng.uniform(0, 1)) for d in distances}
        return acc, [dict(ckpt=str(ckpt), pos=label.split()[0], label=label, task=task,
                          kind="distance", d=d, accuracy=acc[d]) for d in distances]

    zero, zero_rows = rows(task_runs / "xpos_s1337" / "ckpt.pt", "xpos + BCA", "copy")
    _, other_seed = rows(task_runs / "xpos_s1338" / "ckpt.pt", "xpos + BCA", "copy")
    _, other_rule = rows(task_runs / "xpos_s1337" / "ckpt.pt", "xpos + sliding W=128", "copy")
    (results / "raw" / "xpos.tasks.json").write_text(
        json.dumps({"rows": zero_rows + other_seed + other_rule}))
    tuned, tuned_rows = rows(task_runs / "extension" / "xpos_long_s1337" / "ckpt.pt", "xpos",
                             "mqar")
    (results / "raw" / "xpos_long.tasks.json").write_text(json.dumps({"rows": tuned_rows}))
    reproduce.main(["--suite", "extension", "--report", "--schemes", "xpos",
                    "--results", str(results), "--runs", str(tmp_path / "runs"),
                    "--task_runs", str(task_runs)])
    summary = json.loads((results / "summary.json").read_text())
    table = summary["task_suite"]["table"]
    assert set(table) == {"zero-shot: xpos + BCA", "fine-tuned at 4l: xpos"}
    for name, task, acc in (("zero-shot: xpos + BCA", "copy", zero),
                            ("fine-tuned at 4l: xpos", "mqar", tuned)):
        assert set(table[name]) == {task}
        assert (table[name][task]["within"]
                == pytest.approx(np.mean([acc[d] for d in distances if d <= 4 * l])))
        assert (table[name][task]["past"]
                == pytest.approx(np.mean([acc[d] for d in distances if d > 4 * l])))
    assert summary["task_suite"]["extra_tokens"] == 400 * 16 * 512
    tables = (results / "tables.md").read_text()
    assert tables == study_tables.extension_markdown(summary)
    line = next(x for x in tables.splitlines() if x.startswith("| fine-tuned at 4l: xpos |"))
    assert f"| {np.mean([tuned[d] for d in (768, 2048)]):.3f} |" in line
    # the summary records the task suite's checkpoints, a redraw's default --task_runs: the
    # rows stay in (under out/retrieval they would be left out, and the report refused)
    assert summary["task_suite"]["runs"] == str(task_runs)
    reproduce.main(["--suite", "extension", "--report", "--schemes", "xpos",
                    "--results", str(results), "--runs", str(tmp_path / "runs")])
    assert (results / "tables.md").read_text() == tables


@pytest.mark.slow
def test_toy_extension_end_to_end(tmp_path):
    """--suite extension on a toy budget (RoPE only): the study's models, then each fine-tuned at 4l
    with PI and YaRN (the scaling, its original length and the source in the checkpoint), every
    model scored, the table drawn; a second run has nothing to do."""
    argv = [sys.executable, "study/reproduce.py", "--suite", "extension", "--budget", "toy",
            "--schemes", "rope", "--results", str(tmp_path / "results"),
            "--runs", str(tmp_path / "runs"), "--data", str(tmp_path / "data"),
            "--task_runs", str(tmp_path / "task_runs"), "--task_data", str(tmp_path / "task_data")]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert {"zero-shot: rope", "zero-shot: rope + BCA", "zero-shot: rope + yarn",
            "fine-tuned at 4l: rope + pi s=4 from 16", "fine-tuned at 4l: rope + yarn s=4 from 16",
            "fine-tuned at l (control): rope", "fine-tuned at l (control): rope + BCA"
            } <= set(summary["table"])
    control = torch.load(tmp_path / "runs" / "extension" / "rope_more_s1337" / "ckpt.pt",
                         weights_only=False)
    assert control["model_args"]["block_size"] == 16 and control["config"]["batch_size"] == 8
    # every seed's value, YaRN at inference's context gain too (the rows scored again under
    # other flags have perplexity only)
    for name, row in summary["table"].items():
        assert row["64"]["n"] == 3
        assert " dynamic " in name or " a=" in name or row["context gain"]["n"] == 3
    # YaRN's ends: the sweep's least mean perplexity at 4l, and the YaRN fine-tune past 4l with s
    # growing with the length
    grid = summary["yarn"]["grid"]
    assert len(grid) == 15 and all(g["n"] == 3 for g in grid.values())
    best = min(grid, key=lambda k: grid[k]["mean"])
    assert f"{summary['yarn']['alpha']:g},{summary['yarn']['beta']:g}" == best
    assert "fine-tuned at 4l: rope + yarn dynamic from 16" in summary["table"]
    tuned = best != "1,32"  # LLaMA's ends chosen: the tuned fine-tune is rope_yarn itself
    if tuned:
        ends = f" a={summary['yarn']['alpha']:g} b={summary['yarn']['beta']:g}"
        assert {f"fine-tuned at 4l: rope + yarn s=4 from 16{ends}",
                f"zero-shot: rope + yarn{ends}"} <= set(summary["table"])
    for name, method in (("rope_pi", "pi"), ("rope_yarn", "yarn")):
        ckpt = torch.load(tmp_path / "runs" / "extension" / f"{name}_s1338" / "ckpt.pt",
                          weights_only=False)
        args = ckpt["model_args"]
        assert (args["block_size"], args["rope_scaling"], args["rope_factor"],
                args["rope_original_length"]) == (64, method, 4.0, 16)
        assert ckpt["init"]["path"] == str((tmp_path / "runs" / "rope_s1338" / "ckpt.pt").resolve())
    assert ((tmp_path / "results" / "tables.md").read_text()
            == study_tables.extension_markdown(summary))
    again = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    # the suite's part: rope's first seed fine-tuned, its task probe
    suite = summary["task_suite"]["table"]
    assert {"fine-tuned at 4l: rope + pi s=4 from 96",
            "fine-tuned at 4l: rope + yarn s=4 from 96"} <= set(suite)
    ckpt = torch.load(tmp_path / "task_runs" / "extension" / "rope_yarn_s1337" / "ckpt.pt",
                      weights_only=False)
    assert (ckpt["model_args"]["block_size"], ckpt["model_args"]["rope_scaling"]) == (384, "yarn")
    # data, rope's seeds, the fine-tunes at 4l and the control at l (issue 46), perplexity and
    # context of 4 models; the task data at l and at 4l, the suite's rope, its task probe, its two
    # fine-tunes and their task probes; the report
    # and the ends' 15-pair sweep, the fine-tune with the tuned ends (its perplexity and context)
    # and the rows scored again: the dynamic YaRN fine-tune(s), zero-shot under the tuned ends
    jobs = 1 + 3 + 6 + 3 + 2 * 4 + 2 + 1 + 1 + 2 + 2 + 1 + 15 + 1 + (3 + 2 + 2 if tuned else 0)
    assert (again.returncode == 0
            and f"{jobs - 1} of {jobs} jobs finished already" in again.stdout), again.stdout[-2000:]


def test_ctrl_c_is_one_line_naming_the_job_stopped(tmp_path, monkeypatch, capsys):
    """Issue 45 item 15: Ctrl-C printed a traceback through run_jobs -> subprocess.run ->
    os.waitpid, status 130."""
    def interrupted_job(args, budget, jobs):
        monkeypatch.setattr(reproduce, "RUNNING", "train rope_s1337")
        raise KeyboardInterrupt

    monkeypatch.setattr(reproduce, "run_jobs", interrupted_job)
    with pytest.raises(SystemExit) as e:
        reproduce.main(["--budget", "toy", "--schemes", "rope", "--results",
                        str(tmp_path / "r"), "--runs", str(tmp_path / "o"),
                        "--data", str(tmp_path / "d")])
    assert e.value.code == 130
    err = capsys.readouterr().err.strip()
    assert err == ("reproduce.py: interrupted (Ctrl-C): train rope_s1337 stopped; every finished "
                   "job is kept (a training run keeps its last checkpoint): run reproduce.py "
                   "again to go on")


def test_ctrl_c_sent_to_reproduce_alone_stops_its_job():
    """A SIGINT for reproduce.py alone (kill -INT <pid>, not the group) is passed on to the job,
    which would otherwise run on after reproduce.py has exited. (The job takes SIGINT as from a
    terminal: under a background shell, as CI may run the tests, it would be ignored.)"""
    job = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                            "try:\n time.sleep(60)\n"
                            "except KeyboardInterrupt:\n raise SystemExit(130)"])
    began = time.monotonic()
    reproduce.stop_job(job)
    assert job.returncode == 130 and time.monotonic() - began < 30


def test_a_report_reads_its_own_directory_and_budget(tmp_path, capsys):
    """Issue 45 item 11: --report --suite extension on another directory mixed in the committed
    results/retrieval, dropped the run's rows with no note, replaced a populated tables.md with an
    empty table and printed a budget that never ran, status 0."""
    results = tmp_path / "r"
    shutil.copytree(ROOT / "results" / "extension", results)
    tables = (results / "tables.md").read_bytes()
    summary = json.loads((results / "summary.json").read_text())
    summary["budget"] = "toy"
    (results / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(SystemExit) as e:
        reproduce.main(["--report", "--suite", "extension", "--results", str(results),
                        "--budget", "full"])
    assert (f"--results {results} holds the toy budget's results, not --budget full's: give "
            "--budget toy, or none") in str(e.value.code)
    summary["budget"] = "full"
    (results / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(SystemExit) as e:  # the rows' checkpoints are not under these folders
        reproduce.main(["--report", "--suite", "extension", "--results", str(results),
                        "--runs", str(tmp_path / "o"), "--task_runs", str(tmp_path / "t")])
    assert (f"--results {results}: no row of its raw/ was measured on this suite's checkpoints"
            in str(e.value.code))
    assert "rows of out/study_char/rope_s1337/ckpt.pt are left out" in capsys.readouterr().out
    assert (results / "tables.md").read_bytes() == tables
    reproduce.main(["--report", "--suite", "extension", "--results", str(results)])
    assert (results / "tables.md").read_bytes() == tables


@pytest.mark.parametrize("suite, given", [("char", "retrieval"), ("char", "extension"),
                                          ("retrieval", "study"), ("retrieval", "extension"),
                                          ("extension", "study"), ("extension", "retrieval")])
def test_another_suites_results_name_their_own_suite(suite, given):
    """Issue 45 item 19: results/extension without --suite said "give --suite retrieval", and
    with it "drop --suite retrieval": a loop that never named --suite extension."""
    argv = ["--report", "--results", str(ROOT / "results" / suite)]
    with pytest.raises(SystemExit) as e:
        reproduce.main(argv + ([] if given == "study" else ["--suite", given]))
    advice = {"char": f"drop --suite {given}", "retrieval": "give --suite retrieval",
              "extension": "give --suite extension"}[suite]
    assert f"results (raw/): {advice}, or another --results" in str(e.value.code)


@pytest.mark.parametrize("schemes", ["", "rope,", ",xpos"])
def test_an_empty_scheme_name_is_refused(tmp_path, schemes):
    """Issue 45 item 24: --schemes "" ran every scheme."""
    with pytest.raises(SystemExit) as e:
        reproduce.main(["--plan", "--budget", "toy", "--schemes", schemes,
                        "--results", str(tmp_path / "r")])
    assert f"--schemes {schemes!r}: an empty name is not allowed" in str(e.value.code)


def test_a_second_study_on_one_results_directory_names_the_first(tmp_path):
    """Issue 45 item 24: a second reproduce.py on one results directory failed with train.py's
    advice (--init_from=resume or --overwrite=True), naming no other process."""
    results = tmp_path / "r"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; sys.argv = ['reproduce.py']; "
        "from lexgpt.run_dir import own_run_dir; import pathlib; "
        f"pathlib.Path({str(results)!r}).mkdir(); own_run_dir({str(results)!r}, '--results'); "
        "print('held', flush=True); time.sleep(60)")], cwd=ROOT, stdout=subprocess.PIPE,
        text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for extra in ([], ["--report"]):
            (results / "raw").mkdir(exist_ok=True)
            with pytest.raises(SystemExit) as e:
                reproduce.main(["--budget", "toy", "--results", str(results), "--runs",
                                str(tmp_path / "o"), "--data", str(tmp_path / "d"), *extra])
            assert (f"--results {results} is in use by pid {holder.pid} on host"
                    in str(e.value.code)
                    and str(e.value.code).endswith("or give another --results")), extra
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / "o").exists() and not (tmp_path / "d").exists()


def test_a_checkpoints_own_sweep_file_replaces_its_rows_in_the_schemes(tmp_path):
    """raw/rope_s1337.sweep.json (one job per checkpoint) and an older raw/rope.sweep.json of
    the whole scheme: seed 1337's rows are read from its own file only, seed 1338's from the
    scheme's, so that no answer counts twice."""
    import argparse
    runs, raw = tmp_path / "runs", tmp_path / "results" / "raw"
    raw.mkdir(parents=True)

    def rows(seed, d):
        return [{"ckpt": str(runs / f"rope_s{seed}" / "ckpt.pt"), "pos": "rope",
                 "label": "rope + BCA", "d": d}]

    (raw / "rope.sweep.json").write_text(json.dumps({"rows": rows(1337, 8) + rows(1338, 8)}))
    (raw / "rope_s1337.sweep.json").write_text(json.dumps({"rows": rows(1337, 16)}))
    args = argparse.Namespace(results=str(tmp_path / "results"), runs=str(runs))
    found = study_report.scheme_rows(args, "rope", ".sweep.json")
    assert sorted((Path(r["ckpt"]).parent.name, r["d"]) for r in found) == [
        ("rope_s1337", 16), ("rope_s1338", 8)]
