"""Tests for the long-range task suite: every task's instances checked against its rule by brute
force (the answer is what the rule says, at the distance asked), the records prepare_data.py writes
and the batches train.py reads from them, the scorer against a plain forward pass, the retrieval
reach by hand, the probe's command line and the suite in reproduce.py on a toy budget."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import prepare_data
from conftest import make_checkpoint
from lexgpt import data
from lexgpt import retrieval_tasks as tasks
from model import GPT, AttentionRule, GPTConfig
from study import eval_retrieval
from study import jobs as study_jobs

ROOT = Path(__file__).resolve().parents[2]


def brute_force_answers(task, text):
    """What each answer must be, by the task's rule read off the text alone:
    {position: character}."""
    if task == "copy":
        start, gap_end = text.index("<") + 1, text.index(">")
        span = text[start : start + len(text) - gap_end - 1]
        return {gap_end + 1 + i: c for i, c in enumerate(span)}
    if task == "mqar":
        q = text.index("?")
        n = (len(text) - q - 1) // 2
        pairs = text[q - (q - text.index(next(c for c in text if c.isupper()))) : q]
        table = {pairs[i]: pairs[i + 1] for i in range(0, 2 * n, 2)}
        return {q + 2 + 2 * i: table[text[q + 1 + 2 * i]] for i in range(n)}
    if task.startswith("passkey"):
        key = text.split("The pass key is ")[1][:5]
        return {len(text) - 5 + i: c for i, c in enumerate(key)}
    answers, last = {}, None  # flipflop: the bit after each r is the last bit written
    start = len(text) - len(text.lstrip("."))
    for i in range(start, len(text.rstrip(".")), 2):
        if text[i] == "w":
            last = text[i + 1]
        elif text[i] == "r":
            answers[i + 1] = last
    return answers


def source_distance(task, text, answers):
    """The distance from the first answer back to what it retrieves, found by brute force."""
    p = min(answers)
    if task == "copy":
        return p - (text.index("<") + 1)
    if task == "mqar":
        # first pair to first query
        return text.index("?") + 1 - text.index(next(c for c in text if c.isupper()))
    if task.startswith("passkey"):
        return p - (text.index("The pass key is ") + len("The pass key is "))
    start = len(text) - len(text.lstrip("."))
    return max(answers) - 1 - max(i for i in range(start, max(answers), 2) if text[i] == "w")


@pytest.mark.parametrize("task", tasks.TASKS)
def test_training_records_follow_the_tasks_rule(task):
    rng = np.random.default_rng(0)
    for length in (tasks.shortest_record(task), 97, 129, 257):
        for _ in range(40):
            text, answers = tasks.GENERATORS[task](rng, length)
            assert len(text) == length and set(text) <= set(tasks.CHARS) and answers
            truth = brute_force_answers(task, text)
            assert set(answers) == set(truth)  # every answer is marked, and nothing else
            assert {p: text[p] for p in answers} == truth


@pytest.mark.parametrize("task", tasks.TASKS)
def test_evaluation_instances_sit_at_the_distance_asked(task):
    rng = np.random.default_rng(1)
    shortest, extra = tasks.layout(task)
    for distance in (shortest, shortest + 2, 128, 1000):
        distance += distance % 2 if task == "flipflop" else 0
        text, answers = tasks.at_distance(task, rng, distance)
        assert len(text) == tasks.PREFIX + distance + extra
        assert {p: text[p] for p in answers} == {p: brute_force_answers(task, text)[p]
                                                 for p in answers}
        assert source_distance(task, text, answers) == distance
        # the source is past the first tokens sinks keep
        assert min(answers) - distance >= tasks.PREFIX
        if task == "flipflop":  # the instructions at odd positions, as in half the training records
            assert text[0] == "." and text[1] != "." and text[-2] == "r"
        text, answers = tasks.at_length(task, rng, 2048, distance)
        assert len(text) == 2048 and source_distance(task, text, answers) == distance


@pytest.mark.parametrize("task", tasks.TASKS)
def test_instances_where_the_rule_acts_sit_at_the_phase_and_distance_asked(task):
    rng = np.random.default_rng(2)
    shortest, extra = tasks.layout(task)
    for distance, phase in ((0, 0), (40, 63), (96, 17), (200, 32)):
        distance = max(distance, shortest)
        distance += distance % 2 if task == "flipflop" else 0
        text, answers = tasks.at_phase(task, rng, distance, 256, 64, phase)
        assert len(text) == 256 + distance + extra + 63  # one length for every phase
        # what follows the answers is digits, which no rule of the task reads
        body = text[: max(answers) + 1]
        assert {p: text[p] for p in answers} == {p: brute_force_answers(task, body)[p]
                                                 for p in answers}
        assert source_distance(task, body, answers) == distance and min(answers) - distance >= 256
        assert (min(answers) - 1) % 64 == phase  # the query of the first answer
        found = tasks.sources(task, text, answers, distance)
        assert len(found) == len(answers) and min(found) >= 256
        for p, s in zip(answers, found):  # each source holds what its answer must say
            assert (text[s] == text[p] if task != "flipflop"
                    else text[s] == text[p] and text[s - 1] == "w")
        if task == "mqar":  # the first pair is the farthest source
            assert min(answers) - min(found) <= distance


def test_a_distance_that_does_not_fit_is_refused_and_a_bad_task_named():
    rng = np.random.default_rng(0)
    for task, length, distance in (("passkey", 70, 59), ("passkey", 78, 59), ("copy", 30, 25),
                                   ("mqar", 30, 40), ("flipflop", 100, 5), ("flipflop", 100, 0),
                                   ("flipflop", 20, 18)):
        with pytest.raises(ValueError, match=f"{task}: distance {distance} "):
            tasks.at_length(task, rng, length, distance)
    with pytest.raises(ValueError, match="nope not allowed: the tasks are copy, mqar"):
        tasks.parse_tasks("copy,nope")
    assert (tasks.parse_tasks("all") == list(tasks.TASKS)
            and tasks.parse_tasks("mqar,copy,mqar") == ["mqar", "copy"])


@pytest.fixture(scope="module")
def task_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("tasks") / "d"
    prepare_data.main(["--dataset", "task", "--block_size", "96", "--records", "60",
                       "--out_dir", str(out)])
    return out


@pytest.mark.slow
def test_records_are_whole_instances_with_their_answers_marked(task_data):
    meta = data.load_meta(task_data, full=True)
    assert (meta["record"] == 97 and meta["tasks"] == list(tasks.TASKS)
            and meta["chars"] == tasks.CHARS)
    train = data.read_tokens(task_data, "train", meta)
    tokens = train.tokens
    assert len(tokens) == 60 * 97 and len(data.read_tokens(task_data, "val", meta).tokens) == 6 * 97
    for i in range(60):
        text = "".join(tasks.CHARS[t] for t in tokens[i * 97 : (i + 1) * 97])
        turn = [t for t in tasks.TASKS for _ in range(tasks.SHARE[t])]
        task = turn[i % len(turn)]  # in turn, SHARE of each
        marked = set(np.flatnonzero(train.answers[i * 97 : (i + 1) * 97]).tolist())
        truth = brute_force_answers(task, text)
        assert marked and all(text[p] == truth[p] for p in marked)
    offsets = data.sample_offsets(1, 0, 3, train, 16, 96)
    assert (offsets % 97 == 0).all()  # a sequence is a whole record
    x, y = data.get_batch(train, offsets, 96, "cpu")
    for row, at in enumerate(offsets):
        want = np.where(train.answers[at + 1 : at + 97] == 1,
                        tokens[at + 1 : at + 97].astype(np.int64), -1)
        assert y[row].tolist() == want.tolist() and x[row].tolist() == tokens[at : at + 96].tolist()
    with pytest.raises(data.UserError,
                       match="holds task records of 97 tokens, made for block_size 96: train with "
                                             "--block_size=96"):
        data.sample_offsets(1, 0, 3, train, 16, 64)
    subprocess.run([sys.executable, "prepare_data.py", "--verify", str(task_data)], cwd=ROOT,
                   check=True, capture_output=True)


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "copy,bogus"], "--tasks 'copy,bogus': bogus not allowed"),
    (["--block_size", "40", "--tasks", "passkey"], "--block_size 40 is too short for passkey"),
    (["--records", "0"], "--records 0 is not allowed: must be >= 1"),
    (["--tasks", "copy,,mqar"], "--tasks 'copy,,mqar': an empty name not allowed"),
    (["--val_tokens", "100"], "--dataset task: --val_tokens and --passkey do not apply"),
])
@pytest.mark.slow
def test_bad_task_options_are_one_line_errors(tmp_path, argv, message):
    done = subprocess.run([sys.executable, "prepare_data.py", "--dataset", "task",
                           "--out_dir", str(tmp_path / "d"), *argv], cwd=ROOT, capture_output=True,
                          text=True)
    assert (done.returncode == 1 and message in done.stderr
            and len(done.stderr.strip().splitlines()) == 1)
    assert not (tmp_path / "d" / "meta.json").exists()


@pytest.mark.parametrize("scaling", ["none", "pi", "dynamic_ntk"])
@pytest.mark.parametrize("rule", ["causal", "bca"])
def test_predictions_are_the_argmax_of_a_plain_forward_pass(rule, scaling):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=len(tasks.CHARS), n_layer=2, n_head=2,
                          n_embd=16, pos="rope")).eval()
    rng = np.random.default_rng(0)
    texts = [tasks.at_distance("copy", rng, 60)[0] for _ in range(3)]
    idx = tasks.encode(texts)
    first = idx.size(1) - tasks.SPAN
    got = tasks.predictions(model, idx, first, rule, scaling)
    if scaling != "dynamic_ntk":
        logits, _ = model(idx[:, :-1], idx[:, 1:], attention=rule, rope_scaling=scaling)
        assert torch.equal(got, logits[:, first - 1 :].argmax(-1))
    # dynamic NTK: each answer from a full pass over the text before it, at its own length's factor
    else:
        for j, t in enumerate(range(first, idx.size(1))):
            logits, _ = model(idx[:, :t], attention=rule, rope_scaling=scaling)
            assert torch.equal(got[:, j], logits[:, -1].argmax(-1))
    right, n, _ = tasks.accuracy(model, "copy",
                                 [tasks.at_distance("copy", rng, 60) for _ in range(3)], rule,
                                 scaling, "cpu", torch.no_grad())
    assert n == 3 * tasks.SPAN and 0 <= right <= 1


def test_accuracy_scores_the_prediction_for_each_answer(monkeypatch):
    """With predictions forced to the true text the accuracy is 1; shifted by one position it falls
    to chance level; a passkey counts only with all five digits."""
    rng = np.random.default_rng(0)
    for task in tasks.TASKS:
        instances = [tasks.at_distance(task, rng, max(40, tasks.layout(task)[0])) for _ in range(8)]
        for shift, check in ((0, lambda a: a == 1.0), (1, lambda a: a < 0.7)):
            monkeypatch.setattr(tasks, "predictions", lambda model, idx, first, *a:
                                idx[:, first - shift : idx.size(1) - shift])
            accuracy, n, _ = tasks.accuracy(None, task, instances, "causal", "none", "cpu",
                                            torch.no_grad())
            assert (check(accuracy)
                    and n == sum(1 if task.startswith("passkey") else len(p) for _, p in instances))


@pytest.mark.slow
def test_accuracy_by_query_tells_elimination_from_lookup(monkeypatch):
    """MQAR scored per query: a simulated model that picks, at each query, one of the values not yet
    asked for scores tasks.by_elimination's 1/(n - i) at the i-th query (measured over 3,000
    instances of distinct values); one that looks each key up scores 1 at every query."""
    rng, pick = np.random.default_rng(0), np.random.default_rng(1)
    instances = [tasks.at_distance("mqar", rng, 64) for _ in range(5000)]
    n = tasks.PAIR_COUNT
    instances = [(text, ps) for text, ps in instances if len({text[p] for p in ps}) == n][:3000]

    def eliminator(model, idx, first, *a):
        out = idx[:, first:].clone()
        for b, (text, ps) in enumerate(instances):
            left = sorted({text[p] for p in ps})
            for p in ps:  # a value not yet asked for, at random; the one asked for leaves the pool
                out[b, p - first] = int(tasks.encode([pick.choice(left)])[0, 0])
                left.remove(text[p])
        return out

    monkeypatch.setattr(tasks, "predictions", eliminator)
    accuracy, scored, places = tasks.accuracy(None, "mqar", instances, "causal", "none", "cpu",
                                              torch.no_grad())
    assert scored == n * len(instances) and [c for _, c in places] == [len(instances)] * n
    for (right, count), expected in zip(places, tasks.by_elimination(n)):
        # binomial std at 3,000 instances: at most 0.009
        assert abs(right / count - expected) < 0.03
    assert accuracy == pytest.approx(sum(r for r, _ in places) / scored)
    # looks every key up
    monkeypatch.setattr(tasks, "predictions", lambda model, idx, first, *a: idx[:, first:])
    _, _, places = tasks.accuracy(None, "mqar", instances[:50], "causal", "none", "cpu",
                                  torch.no_grad())
    assert places == [(50, 50)] * n


def test_retrieval_reach_by_hand():
    def rows(accs, extra=9):
        return [dict(d=d, length=d + extra, accuracy=a) for d, a in accs]
    reach = eval_retrieval.retrieval_reach
    accuracies = [(32, 1.0), (64, 0.9), (120, 0.95), (128, 0.5), (256, 0.86), (512, 0.2)]
    # 1 x: the instances of at most 129 tokens (d <= 120): mean 0.95; 0.5 at 128 is below 0.9 x 0.95
    assert reach(rows(accuracies), 128, 0.02) == (120, pytest.approx(0.95))
    # 0.86 >= 0.855
    assert reach(rows(accuracies[:3] + accuracies[4:]), 128, 0.02) == (256, pytest.approx(0.95))
    assert (reach(rows([(32, 1.0), (64, 0.5), (96, 1.0), (256, 1.0)]), 128, 0.02)
            == (32, pytest.approx(2.5 / 3)))
    # not half way from chance to 1
    assert reach(rows([(32, 0.6), (96, 0.6), (256, 0.6)]), 128, 0.5)[0] is None
    assert reach(rows([(32, 0.9), (96, 0.9), (2048, 0.9)]), 128, 0.5) == (2048, 0.9)
    # a passkey-like instance: at d = 96 it needs 135 tokens, more than a training record
    # holds, so it is not 1 x
    assert (reach(rows([(59, 1.0), (64, 0.9), (96, 0.3), (128, 0.0)], extra=39), 128, 0.0)
            == (64, pytest.approx(0.95)))
    assert reach(rows([(200, 1.0)]), 128, 0.0) == (None, None)


def test_flipflop_training_records_hold_every_even_distance_up_to_their_length():
    rng = np.random.default_rng(2)
    seen, longest = set(), []
    for _ in range(3000):
        text, answers = tasks.flipflop(rng, 129)
        start = len(text) - len(text.lstrip("."))
        distances = [p - 1 - max(i for i in range(start, p, 2) if text[i] == "w") for p in answers]
        seen, longest = seen | set(distances), longest + [max(distances)]
    assert seen == set(range(2, 125, 2))  # every even distance, none odd, none past the record
    # half the records end in a read at a uniform distance
    assert 0.15 < np.mean(np.array(longest) > 64) < 0.35


def test_task_probe_json_table_plots_and_errors(task_data, tmp_path, capsys):
    meta = data.load_meta(task_data)
    make_checkpoint(tmp_path / "m.pt", task_data, pos="rope", block_size=96, vocab=meta["chars"])
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    eval_retrieval.main([str(a) for a in ("--ckpt", tmp_path / "m.pt", "--probe", "task", "--task",
                                          "copy,flipflop", "--distances", "10,50,200",
                                          "--lengths", "96,384", "--sequences", 3,
                                          "--attention", "causal,bca",
                                          "--rope_scaling", "none,yarn", "--json", out,
                                          "--plot", png)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["tasks"] == ["copy", "flipflop"]
    copy = [(r["label"], r["kind"], r["d"], r["length"]) for r in rows if r["task"] == "copy"]
    assert copy[:5] == [("rope", "distance", 10, 16 + 10 + 9), ("rope", "distance", 50, 75),
                        ("rope", "distance", 200, 225), ("rope", "length", 48, 96),
                        ("rope", "length", 48, 384)]
    # yarn under BCA: skipped
    assert {r["label"] for r in rows} == {"rope", "rope + yarn", "rope + BCA"}
    assert {r["reach_bound"] for r in rows if r["label"] == "rope + BCA"} == {2 * 96 // 2}
    assert all(r["n"] == 3 * (tasks.SPAN if r["task"] == "copy" else 1) for r in rows)
    assert ("copy, by distance" in printed and "| rope + BCA | " in printed
            and "retrieval reach" in printed)
    assert ((tmp_path / "t_copy.png").stat().st_size > 1000
            and (tmp_path / "t_flipflop.png").stat().st_size > 1000)
    for argv, message in ((["--task", "copy", "--span", "4"],
                           "--span does not apply to --probe task"),
                          (["--task", "cop"], "--task 'cop': cop not allowed"),
                          (["--lengths", "20"], "--lengths 20 cannot hold copy")):
        with pytest.raises(SystemExit) as e:
            eval_retrieval.main(["--ckpt", str(tmp_path / "m.pt"), "--probe", "task", *argv])
        assert message in str(e.value.code)


def test_the_task_probe_scores_mqar_by_query(task_data, tmp_path, capsys):
    """Each MQAR row holds its accuracy at each query, whose mean is the row's accuracy (every query
    is scored once per instance), and the notes set the queries at 1 x beside what picking by
    elimination would score."""
    meta = data.load_meta(task_data)
    make_checkpoint(tmp_path / "m.pt", task_data, pos="rope", block_size=96, vocab=meta["chars"])
    out = tmp_path / "t.json"
    eval_retrieval.main([str(a) for a in ("--ckpt", tmp_path / "m.pt", "--probe", "task", "--task",
                                          "mqar", "--distances", "20,200", "--lengths", "96",
                                          "--sequences", 4, "--json", out)])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 and all(len(r["by_query"]) == tasks.PAIR_COUNT for r in rows)
    for r in rows:
        assert r["accuracy"] == pytest.approx(np.mean(r["by_query"]))
    printed = capsys.readouterr().out
    assert "mqar: accuracy by query, 1st to last, at 1 x: " in printed
    assert "(picking among the values not yet asked for: 0.17 0.20 0.25 0.33 0.50 1.00)" in printed


def test_the_task_probe_refuses_a_model_of_natural_text(tiny_data, tmp_path):
    make_checkpoint(tmp_path / "m.pt", tiny_data)
    with pytest.raises(SystemExit) as e:
        eval_retrieval.main(["--ckpt", str(tmp_path / "m.pt"), "--probe", "task"])
    assert "was not trained on the task suite" in str(e.value.code)


def test_learned_positions_are_scored_within_the_training_length(task_data, tmp_path):
    meta = data.load_meta(task_data)
    make_checkpoint(tmp_path / "m.pt", task_data, pos="learned", block_size=96, vocab=meta["chars"])
    rows = eval_retrieval.main([str(a) for a in ("--ckpt", tmp_path / "m.pt", "--probe", "task",
                                                 "--task", "copy", "--sequences", 1,
                                                 "--attention", "causal")])
    # the default distances 24, 48, 72, ... x 96 / 128: 48 + PREFIX + 9 fits in 96
    # positions, 72 + 25 does not
    assert (rows and max(r["length"] for r in rows) <= 96
            and {r["d"] for r in rows if r["kind"] == "distance"} == {24, 48})


@pytest.mark.slow
def test_the_suite_in_reproduce_on_a_toy_budget(tmp_path):
    argv = [sys.executable, "study/reproduce.py", "--suite", "retrieval", "--budget", "toy",
            "--schemes", "learned,rope", "--results", str(tmp_path / "results"),
            "--runs", str(tmp_path / "runs"), "--data", str(tmp_path / "data")]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = tmp_path / "results"
    summary = json.loads((results / "summary.json").read_text())
    raw = study_jobs.read_result(results / "raw" / "rope.tasks.json")  # every row in full
    assert {r["ckpt"] for r in raw["rows"]} == {str(tmp_path / "runs" / f"rope_s{s}" / "ckpt.pt")
                                                 for s in (1337, 1338, 1339)}
    # every rule for both; the interpolations for rope only; learned within its training
    # length (96 at toy size)
    assert {"rope", "rope + BCA", "rope + sliding W=96", "rope + sinks S=4 W=96", "rope + pi",
            "rope + ntk", "rope + dynamic_ntk", "rope + yarn", "learned",
            "learned + BCA"} <= set(summary["reach"])
    assert summary["reach"]["rope + BCA"]["copy bound"] == {"mean": 1 * 96 / 2, "std": 0.0, "n": 3,
                                                            "of": 3, "values": [48, 48, 48]}
    copy_2048 = [r["accuracy"] for r in raw["rows"] if r["label"] == "rope" and r["task"] == "copy"
                 and r["kind"] == "distance" and r["d"] == 1536]
    assert (summary["accuracy"]["rope"]["copy distance 1536"]["mean"]
            == pytest.approx(np.mean(copy_2048)))
    assert max(int(k.split()[-1]) for k in summary["accuracy"]["learned"] if "distance" in k) <= 96
    within = [r["by_query"] for r in raw["rows"] if r["label"] == "rope" and r["task"] == "mqar"
              and r["kind"] == "distance" and r["length"] <= 97
              and r["ckpt"].endswith("rope_s1338/ckpt.pt")]
    assert (within
            and summary["mqar_by_query"]["rope_s1338"] == pytest.approx(np.mean(within, axis=0)))
    for task in tasks.TASKS:
        assert (results / f"{task}.png").stat().st_size > 1000
    tables = (results / "tables.md").read_text()
    assert "### Retrieval reach" in tables and "| rope + yarn |" in tables
    assert "### copy: accuracy by distance" in tables and "### mqar: accuracy by query" in tables
    # where the rule acts: rope's three seeds under every rule, each zone's accuracy the
    # pooled share of its seed's
    sweep = [row for seed in (1337, 1338, 1339)  # one file per checkpoint
             for row in study_jobs.read_result(results / "raw" / f"rope_s{seed}.sweep.json")
             ["rows"]]
    assert ({r["task"] for r in sweep} == {"copy", "mqar", "passkey"}
            and "learned" not in summary["sweep"])
    assert {r["attention"] for r in sweep} == {"bca", "sliding", "sinks"}
    for name, rule in (("rope + BCA", "bca"), ("rope + sliding W=96", "sliding")):
        mine = [r for r in sweep if r["attention"] == rule and r["task"] == "copy"]
        shares = []
        for seed in (1337, 1338, 1339):
            rows = [r for r in mine if r["ckpt"].endswith(f"rope_s{seed}/ckpt.pt")]
            right, n = (sum(r["zones"]["direct"][i] for r in rows) for i in (0, 1))
            shares.append(right / n)
        assert summary["sweep"][name]["copy direct"]["values"] == pytest.approx(shares)
    assert (summary["sweep"]["rope + BCA"]["bound"] == [48, 95]
            and summary["sweep"]["rope + sliding W=96"]["bound"] == [95, 95])
    assert ("### copy where the rule acts" in tables
            and (results / "sweep_copy.png").stat().st_size > 1000)
    # the headline: area under accuracy against log distance, its interval, paired with
    # causal on the same models
    area = summary["area"]
    assert area["rope"]["copy"]["n"] == 3 and area["rope + BCA"]["copy paired"]["n"] == 3
    assert area["rope + BCA"]["copy paired"]["mean"] == pytest.approx(
        area["rope + BCA"]["copy"]["mean"] - area["rope"]["copy"]["mean"])
    again = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    # only the report
    # (prepare, learned: train, tasks; rope: three trains, each with its sweep, then tasks)
    assert again.returncode == 0 and "10 of 11 jobs finished already; 1 to run" in again.stdout


def test_several_checkpoints_keep_their_own_rows(task_data, tmp_path, capsys):
    meta = data.load_meta(task_data)
    for run, seed in (("a", 0), ("b", 1)):
        (tmp_path / run).mkdir()
        make_checkpoint(tmp_path / run / "ckpt.pt", task_data, pos="rope", block_size=96,
                        vocab=meta["chars"], seed=seed)
    rows = eval_retrieval.main([str(a) for a in ("--ckpt", tmp_path / "a" / "ckpt.pt",
                                                 "--ckpt", tmp_path / "b" / "ckpt.pt",
                                                 "--probe", "task", "--task", "mqar",
                                                 "--distances", "20,40", "--lengths", "96",
                                                 "--sequences", 2, "--attention", "causal")])
    printed = capsys.readouterr().out
    assert len(rows) == 2 * 3 and "| rope [a] | " in printed and "| rope [b] | " in printed


@pytest.mark.slow
def test_task_flags_elsewhere_and_a_damaged_record_length_are_one_line_errors(task_data, tmp_path):
    done = subprocess.run([sys.executable, "prepare_data.py", "--records", "10",
                           "--out_dir", str(tmp_path / "d")],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 1 and "--records apply to --dataset task only" in done.stderr
    copy = tmp_path / "copy"
    shutil.copytree(task_data, copy)
    meta = json.loads((copy / "meta.json").read_text())
    for record, answers in ((96, True), (97, False)):
        broken = dict(meta, record=record, files={k: v for k, v in meta["files"].items()
                                                  if answers or not k.endswith("_answers")})
        (copy / "meta.json").write_text(json.dumps(broken))
        with pytest.raises(data.UserError, match="record=96 is not allowed" if record == 96 else
                           "the answers files .* do not match the token files"):
            data.load_meta(copy)


@pytest.mark.parametrize("n_layer", [1, 2])
def test_what_a_query_sees_is_what_a_token_can_change(n_layer):
    """eval_retrieval.sight by brute force: under each window rule, a token `back` tokens before a
    query past the first blocks changes that query's output iff one layer's window holds it (1
    layer), or n_layer windows relay it."""
    torch.manual_seed(0)
    config = GPTConfig(block_size=16, vocab_size=11, n_layer=n_layer, n_head=2, n_embd=16,
                       pos="rope")
    model = GPT(config).eval()
    idx = torch.randint(0, 11, (1, 80))
    for rule in (AttentionRule("bca"), AttentionRule("sliding", 10), AttentionRule("sinks", 10, 2)):
        rule = rule.resolve(80, 16)
        base = model.hidden_states(idx, rule)
        # every phase of H = 8; past the sinks
        cases = [(t, back) for t in range(72, 80) for back in range(1, t - 2)]
        changed = idx.repeat(len(cases), 1)
        for i, (t, back) in enumerate(cases):
            changed[i, t - back] = (changed[i, t - back] + 1) % 11
        moved = (model.hidden_states(changed, rule) - base).abs().amax(-1) > 1e-6
        for i, (t, back) in enumerate(cases):
            one, through = eval_retrieval.sight(config, rule, t % 8)
            assert bool(moved[i, t]) == (back <= through), (rule, t, back)
            assert eval_retrieval.zone(config, rule, t % 8, back) == (
                "direct" if back <= one else "relay" if back <= through else "beyond")
        assert eval_retrieval.reach_bound(config, rule) == eval_retrieval.sight(config, rule, 0)[1]


def test_the_sweep_places_every_phase_and_counts_every_answer(task_data, tmp_path, capsys):
    meta = data.load_meta(task_data)
    make_checkpoint(tmp_path / "m.pt", task_data, pos="rope", block_size=96, vocab=meta["chars"])
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    eval_retrieval.main([str(a) for a in ("--ckpt", tmp_path / "m.pt", "--probe", "task", "--sweep",
                                          "--task", "copy,passkey", "--distances", "10,70,130",
                                          "--sequences", 6, "--attention", "causal,bca,sliding",
                                          "--json", out, "--plot", png)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert (result["phase_bins"] == eval_retrieval.PHASE_BINS
            and result["tasks"] == ["copy", "passkey"])
    shortest = tasks.layout("passkey")[0]
    assert sorted({(r["task"], r["d"]) for r in result["rows"]}) == [
        ("copy", 10), ("copy", 70), ("copy", 130), ("passkey", max(10, shortest)), ("passkey", 70),
        ("passkey", 130)]
    for r in result["rows"]:
        assert (r["kind"] == "sweep"
                and r["length"] == 2 * 96 + r["d"] + tasks.layout(r["task"])[1] + 47)
        assert r["n"] == 6 * (tasks.SPAN if r["task"] == "copy" else 1)
        assert sum(n for _, n in r["zones"].values()) == r["n"] == sum(n for _, n in r["by_phase"])
        assert (sum(right for right, _ in r["zones"].values())
                == pytest.approx(r["accuracy"] * r["n"]))
        zones = {z for z, (_, n) in r["zones"].items() if n}
        if r["attention"] == "causal" or r["d"] <= 48:  # within every query's window
            assert zones == {"direct"}
        # 129 back: past H + phase <= 95, relayed from phase 33 on
        elif r["attention"] == "bca" and r["d"] == 130:
            assert (zones <= {"relay", "beyond"}
                    and (r["reach_bound"], r["reach_bound_max"]) == (96, 143))
        elif r["attention"] == "sliding" and r["d"] == 130:  # W - 1 = 95 < 129 <= 2 x 95
            assert zones == {"relay"} and r["reach_bound"] == r["reach_bound_max"] == 190
    assert ("copy, where the rule acts" in printed and "| rope + BCA | " in printed
            and "96–143" in printed)
    assert (tmp_path / "s_copy.png").stat().st_size > 1000
    for argv, message in ((["--lengths", "200"],
                           "--lengths does not apply to --probe task --sweep"),):
        with pytest.raises(SystemExit) as e:
            eval_retrieval.main(["--ckpt", str(tmp_path / "m.pt"), "--probe", "task",
                                 "--sweep", *argv])
        assert message in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        eval_retrieval.main(["--ckpt", str(tmp_path / "m.pt"), "--probe", "passkey", "--sweep"])
    assert "--sweep applies to --probe task and repeat only" in str(e.value.code)


def test_a_plot_per_task_checks_the_files_it_writes(task_data, tmp_path):
    """--plot F with several tasks writes F_<task>: a foreign F_<task> is refused before any scoring
    and kept, and a foreign F, never written, does not stand in the way."""
    meta = data.load_meta(task_data)
    make_checkpoint(tmp_path / "m.pt", task_data, pos="rope", block_size=96, vocab=meta["chars"])
    (tmp_path / "r_copy.png").write_text("precious")
    argv = ["--ckpt", str(tmp_path / "m.pt"), "--probe", "task", "--task", "copy,mqar",
            "--lengths", "96", "--distances", "20", "--sequences", "1",
            "--plot", str(tmp_path / "r.png")]
    with pytest.raises(SystemExit) as e:
        eval_retrieval.main(argv)
    assert (f"--plot {tmp_path / 'r_copy.png'} exists and is not an earlier plot"
            in str(e.value.code))
    assert (tmp_path / "r_copy.png").read_text() == "precious"
    (tmp_path / "r_copy.png").unlink()
    (tmp_path / "r.png").write_text("mine")
    eval_retrieval.main(argv)
    assert ((tmp_path / "r.png").read_text() == "mine"
            and (tmp_path / "r_mqar.png").stat().st_size > 1000)


def test_json_and_a_per_task_plot_never_name_one_file(task_data, tmp_path):
    """Issue 45 item 7: --json r_copy.png --plot r.png wrote the copy plot over the JSON, status
    0; refused before any scoring, nothing written."""
    meta = data.load_meta(task_data)
    make_checkpoint(tmp_path / "m.pt", task_data, pos="rope", block_size=96, vocab=meta["chars"])
    for names, json_name in (("copy,mqar", "r_copy.png"), ("copy", "r.png")):
        with pytest.raises(SystemExit) as e:
            eval_retrieval.main(["--ckpt", str(tmp_path / "m.pt"), "--probe", "task", "--task",
                                 names, "--lengths", "96", "--distances", "20", "--sequences", "1",
                                 "--json", str(tmp_path / json_name),
                                 "--plot", str(tmp_path / "r.png")])
        assert (f"--json and --plot name the same file {tmp_path / json_name}"
                in str(e.value.code))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]


def test_sequences_that_cannot_fit_are_refused_before_any_work(task_data, tmp_path):
    """Issue 45 item 16: --sequences 100000000 built the instances until memory ran out."""
    meta = data.load_meta(task_data)
    make_checkpoint(tmp_path / "m.pt", task_data, pos="rope", block_size=96, vocab=meta["chars"])
    with pytest.raises(SystemExit) as e:
        eval_retrieval.main(["--ckpt", str(tmp_path / "m.pt"), "--probe", "task", "--task",
                             "copy", "--lengths", "96", "--sequences", "100000000"])
    assert (f"--sequences 100000000 is not allowed for {tmp_path / 'm.pt'}: 100,000,000 "
            "sequences of up to") in str(e.value.code)


def test_distances_and_batch_sizes_that_cannot_be_are_one_line_errors(task_data, tmp_path):
    meta = data.load_meta(task_data)
    make_checkpoint(tmp_path / "m.pt", task_data, pos="rope", block_size=96, vocab=meta["chars"])
    for argv, message in ((["--distances", "-4"],
                           "--distances '-4' is not allowed: distances from an answer"),
                          (["--distances", "0,20"], "--distances '0,20' is not allowed"),
                          (["--batch_tokens", "-5"],
                           "--batch_tokens -5 is not allowed: must be >= 1"),
                          # built before they are scored: a mistyped length would take
                          # all memory (finding 19)
                          (["--lengths", "1000000000"],
                           "--lengths 1000000000 is not allowed: the task probe's "
                           "instances hold at most 1,048,576 tokens"),
                          (["--distances", "2000000"],
                           "--distances 2000000 is not allowed: the task probe's"),
                          (["--sweep", "--distances", "2000000"],
                           "--distances 2000000: the sweep's instances would "
                           "hold 2,000,")):
        with pytest.raises(SystemExit) as e:
            eval_retrieval.main(["--ckpt", str(tmp_path / "m.pt"), "--probe", "task", *argv])
        assert message in str(e.value.code)


def test_a_passkey_counts_in_the_zone_of_its_worst_digit():
    """The passkey is one mark for five digits: with the first digit's query at phase 62 of 64, the
    third digit's query starts the next segment and sees 64 tokens back, not 126: a key 99 back is
    direct for the first two digits, relayed for the rest, so the instance counts as relayed."""
    config = GPTConfig(block_size=128, vocab_size=len(tasks.CHARS), n_layer=2, n_head=2, n_embd=16)
    rule = AttentionRule("bca").resolve(600, 128)
    text, answers = tasks.at_phase("passkey", np.random.default_rng(0), 100, 256, 64, 62)
    row = eval_retrieval.sweep_row(config, rule, "passkey", 100, [(text, answers)], [[True]])
    assert row["zones"] == {"direct": [0, 0], "relay": [1, 1], "beyond": [0, 0]}
    assert [eval_retrieval.zone(config, rule, (p - 1) % 64, 99)
            for p in answers] == ["direct"] * 2 + ["relay"] * 3
