"""
The slow attacks on the processes' life cycle (issue 22), not part of the pytest suite: real signals
and real races, each checked for what must hold after it. Part of `make test-all`.

    python tests/hostile.py                 # all of them, a few minutes on 2 CPU cores
    python tests/hostile.py --only race     # or orphan, sigint_study, sigint, sigint_eval,
                                            # sigint_scripts, outputs, sigint_torchrun, full,
                                            # prepare_kill, sigterm_keep

- race: two trainers started together on one out_dir (--init_from=resume, then --overwrite=True):
  one trains to the end with a complete log, the other is a one-line error naming the first's pid
  and touches nothing.
- orphan: kill -9 of reproduce.py alone while its train.py job runs (held with SIGSTOP, so that it
  cannot just finish): the job dies with it, and reproduce.py run again finishes the study.
- sigint_study: Ctrl-C to reproduce.py's process group while its train.py job runs: the job's line
  and reproduce.py's (naming the job stopped), no traceback, status 130.
- sigint: Ctrl-C (SIGINT) at random moments of a run that writes a checkpoint every iteration: one
  line and status 130 each time, the checkpoint it names loads, and the run resumes to its end.
- sigint_eval: Ctrl-C in the middle of eval_extrapolate.py: one line, status 130, no --json written.
- sigint_scripts: the same in eval_retrieval.py, sample.py, resolution.py and prepare_data.py (with
  two workers busy, the signal to the whole process group).
- outputs: the data-loss repros of issue 45: --json and --plot naming one file (eval_retrieval.py,
  resolution.py), --plot onto a user's file that only looks like an image, make gpu-study without
  CUDA over the last run's log, a report on another results directory: each refused in one line
  with the files kept, and a report that reads its own directory's rows alone.
- sigint_torchrun: Ctrl-C to torchrun's process group (as a terminal sends it) mid-run: the line
  once, from rank 0.
- full: a write the kernel refuses half-way, as on a full disk: a file-size limit (ulimit -f, with
  SIGXFSZ ignored, so that the write fails with EFBIG as it would with ENOSPC) below a checkpoint's
  size while train.py resumes, and below the token files' while prepare_data.py replaces a dataset:
  one line each, status 1, and the checkpoint or dataset from before intact.
- prepare_kill: kill -9 of prepare_data.py alone while its two workers tokenize a long one-line
  document (in pieces) into a folder holding a dataset: the workers die with it, the dataset from
  before is intact, and the next run finishes and leaves none of the killed run's files.
- sigterm_keep: SIGTERM (a scheduler's preemption) at random moments of a run keeping 2 checkpoints:
  one line each time, the checkpoint it names loads, no more than 2 numbered checkpoints are kept,
  and the run resumes to its end with its log whole.

Prints one line per check and exits 1 unless every one held.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
# the tests' data and arguments
from test_train import logged_iters, tiny_args, words_dataset  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1")
# The interrupted runs' length: three stops land within the first hundred iterations, and a run must
# not reach its end between a stop's moment and its signal even on a busy machine (an iteration
# takes about 10 ms on 2 CPU cores: this leaves some 20 s).
INTERRUPTED_ITERS = 2000
# The raced runs' length: the later of two trainers started together must reach out_dir's lock
# before the first ends, even when its start (importing torch) is seconds late on a busy machine.
RACE_ITERS = 600
failures = []


def check(ok, what, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {what}" + ("" if ok else f": {detail[-1500:]}"), flush=True)
    if not ok:
        failures.append(what)


def terminal_sigint():
    """The child's SIGINT as in a terminal: started from a background job it would be ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(cmd, **kwargs):
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=terminal_sigint, **kwargs)


def wait_for(condition, proc, seconds=300):
    deadline = time.monotonic() + seconds
    while proc.poll() is None and not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc.poll() is None and condition()


def train_log(out):
    return ([json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
            if (out / "log.jsonl").exists() else [])


def race(tmp, data):
    base = tmp / "base"
    subprocess.run([sys.executable, "train.py",
                    *tiny_args(data, base, max_iters=20, eval_interval=10)],
                   cwd=ROOT, env=ENV, check=True, capture_output=True)
    for name, extra in (("resume", dict(init_from="resume")), ("overwrite", dict(overwrite=True))):
        out = tmp / f"race_{name}"
        shutil.copytree(base, out)
        args = tiny_args(data, out, max_iters=RACE_ITERS, eval_interval=2, eval_iters=1, **extra)
        procs = [start([sys.executable, "train.py", *args]) for _ in range(2)]
        errs = [p.communicate(timeout=900)[1] for p in procs]
        results = [(p.pid, p.returncode, None, err) for p, err in zip(procs, errs)]
        won = [r for r in results if r[1] == 0]
        lost = [r for r in results if r[1] != 0]
        check(len(won) == 1 and len(lost) == 1, f"race {name}: one trainer of two runs",
              "\n".join(f"pid {r[0]} exit {r[1]}: {r[3]}" for r in results))
        if len(won) == 1 and len(lost) == 1:
            err = lost[0][3].strip()
            check(lost[0][1] == 1 and len(err.splitlines()) == 1
                  and f"is in use by pid {won[0][0]} on host" in err,
                  f"race {name}: the other is one line naming the owner's pid", err)
            iters = [e["iter"] for e in train_log(out) if "loss" in e]
            check(iters == list(range(RACE_ITERS)), f"race {name}: the owner's log is complete",
                  f"iters {iters[:3]}...{iters[-3:]}")
            import torch
            last = torch.load(out / "ckpt.pt", weights_only=True)["iter_num"]
            check(last == RACE_ITERS and not (out / "lock").exists(),
                  f"race {name}: its checkpoint is at the end, and the lock is gone")


def children(pid):
    """The pids of pid's children (Linux /proc)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        kids += ([int(k) for k in (task / "children").read_text().split()]
                 if (task / "children").exists() else [])
    return kids


def cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def orphan(tmp):
    study = tmp / "study"
    argv = [sys.executable, "study/reproduce.py", "--budget", "toy", "--schemes", "rope",
            "--results", str(study / "results"), "--runs", str(study / "runs"),
            "--data", str(study / "data")]
    proc = start(argv)
    trainer = []
    found = wait_for(lambda: trainer
                     or trainer.extend(k for k in children(proc.pid) if "train.py" in cmdline(k)),
                     proc, 600)
    check(found, "orphan: reproduce.py starts a train.py job",
          proc.stderr.read() if proc.poll() is not None else "")
    if not found:
        proc.kill()
        return
    # held still: a toy job would otherwise finish by itself in a second
    os.kill(trainer[0], signal.SIGSTOP)
    proc.kill()  # kill -9 of reproduce.py alone: not its process group
    proc.wait()
    deadline = time.monotonic() + 60
    while alive(trainer[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    check(not alive(trainer[0]), "orphan: its train.py job dies with it", cmdline(trainer[0]))
    if alive(trainer[0]):
        os.kill(trainer[0], signal.SIGKILL)
    done = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1800)
    check(done.returncode == 0 and "jobs are finished" in done.stdout,
          "orphan: reproduce.py run again finishes", done.stdout[-1000:] + done.stderr)


def sigint_study(tmp):
    """Ctrl-C to reproduce.py's process group (as a terminal sends it) while its train.py job
    runs (held with SIGSTOP until the signal is sent, so that it cannot finish first)."""
    study = tmp / "study"
    argv = [sys.executable, "study/reproduce.py", "--budget", "toy", "--schemes", "rope",
            "--results", str(study / "results_sigint"), "--runs", str(study / "runs_sigint"),
            "--data", str(study / "data")]
    proc = start(argv, start_new_session=True)
    trainer = []
    log = study / "runs_sigint" / "rope_s1337" / "log.jsonl"  # written once it trains
    found = wait_for(lambda: log.exists() and (trainer or trainer.extend(
        k for k in children(proc.pid) if "train.py" in cmdline(k))), proc, 600)
    check(found, "sigint_study: reproduce.py starts a train.py job",
          proc.stderr.read() if proc.poll() is not None else "")
    if not found:
        proc.kill()
        return
    os.kill(trainer[0], signal.SIGSTOP)
    os.killpg(proc.pid, signal.SIGINT)
    os.kill(trainer[0], signal.SIGCONT)
    err = proc.communicate(timeout=300)[1].strip()
    lines = err.splitlines()
    check(proc.returncode == 130 and "Traceback" not in err and lines
          and lines[-1].startswith("reproduce.py: interrupted (Ctrl-C): train rope_s1337 stopped")
          and all(line.startswith(("train.py: interrupted", "reproduce.py:")) for line in lines),
          "sigint_study: reproduce.py and its job, one line each, status 130",
          f"exit {proc.returncode}: {err}")
    check(not alive(trainer[0]), "sigint_study: the job stopped with it", cmdline(trainer[0]))


def interrupted(name, out, args, sig, seed, rounds=3):
    """A run started `rounds` times, each stopped by sig at a random moment (and resumed the next
    time): yields (round, the process, its stderr, the iteration its checkpoint holds), then checks
    that the run resumes to its end with its log whole."""
    import torch
    rng = random.Random(seed)
    for k in range(rounds):
        resume = ["--init_from=resume"] if (out / "ckpt.pt").exists() else []
        proc = start([sys.executable, "train.py", *args, *resume])
        at = (max(logged_iters(out)) if (out / "log.jsonl").exists() and resume
              else 0) + rng.randint(2, 8)
        if not wait_for(lambda: (out / "log.jsonl").exists()
                        and any(i >= at for i in logged_iters(out)), proc):
            proc.kill()  # a stalled run would keep communicate() waiting
            check(False, f"{name} {k}: the run ended or stalled before iteration {at}",
                  proc.communicate()[1])
            return
        # somewhere in an iteration, an evaluation or a checkpoint's write
        time.sleep(rng.random() * 0.3)
        proc.send_signal(sig)
        err = proc.communicate(timeout=120)[1].strip()
        yield k, proc, err, torch.load(out / "ckpt.pt", weights_only=True)["iter_num"]
    done = subprocess.run([sys.executable, "train.py", *args, "--init_from=resume"], cwd=ROOT,
                          env=ENV, capture_output=True, text=True)
    iters = [e["iter"] for e in train_log(out) if "loss" in e]
    check(done.returncode == 0 and iters == list(range(INTERRUPTED_ITERS)),
          f"{name}: the run resumes to its end, its log whole",
          done.stderr + f" iters {iters}")


def sigint(tmp, data):
    out = tmp / "sigint"
    args = tiny_args(data, out, max_iters=INTERRUPTED_ITERS, eval_interval=1, eval_iters=1,
                     keep_checkpoints=2)
    for k, proc, err, saved in interrupted("sigint", out, args, signal.SIGINT, seed=0):
        check(proc.returncode == 130 and len(err.splitlines()) == 1 and "Traceback" not in err
              and f"(iter {saved}) is kept: continue with --init_from=resume" in err,
              f"sigint {k}: one line naming the checkpoint kept (iter {saved}), status 130",
              f"exit {proc.returncode}: {err}")


def sigint_eval(tmp, data):
    ckpt = tmp / "base" / "ckpt.pt"
    if not ckpt.exists():
        subprocess.run([sys.executable, "train.py", *tiny_args(data, tmp / "base", max_iters=4)],
                       cwd=ROOT, env=ENV, check=True, capture_output=True)
    ready = tmp / "scoring"
    # the real script, held in its first scoring pass until the signal comes (it would finish
    # in a blink)
    code = (f"import sys, time, pathlib; sys.path.insert(0, {str(ROOT)!r}); "
            "import eval_extrapolate as e; s = e.score\n"
            f"def slow(*a):\n    pathlib.Path({str(ready)!r}).touch(); time.sleep(60); "
            "return s(*a)\n"
            f"e.score = slow; e.main(['--ckpt', {str(ckpt)!r}, '--lengths', '8,16', '--json', "
            f"{str(tmp / 'eval.json')!r}])")
    proc = start([sys.executable, "-c", code])
    wait_for(ready.exists, proc)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1].strip()
    check(proc.returncode == 130
          and err.startswith("eval_extrapolate.py: interrupted (Ctrl-C): nothing was written")
          and len(err.splitlines()) == 1 and not (tmp / "eval.json").exists(),
          "sigint_eval: one line, status 130, no --json", f"exit {proc.returncode}: {err}")


def sigint_scripts(tmp, data):
    """Ctrl-C in eval_retrieval.py, sample.py, resolution.py and prepare_data.py (its workers busy):
    each held in its work until the signal comes, then one line and status 130."""
    ckpt = tmp / "base" / "ckpt.pt"
    if not ckpt.exists():
        subprocess.run([sys.executable, "train.py", *tiny_args(data, tmp / "base", max_iters=4)],
                       cwd=ROOT, env=ENV, check=True, capture_output=True)
    (tmp / "big").mkdir(exist_ok=True)
    (tmp / "big" / "a.txt").write_text("pack my box with five dozen liquor jugs\n\n" * 2000)
    cases = (("study.eval_retrieval", "second_copy_nll", ["--ckpt", str(ckpt), "--probe", "repeat",
                                                          "--span", "4", "--distances", "0",
                                                          "--sequences", "2"]),
             ("sample", "sample", ["--ckpt", str(ckpt), "--max_new_tokens", "4"]),
             ("resolution", "theory", ["--theory", "--json", str(tmp / "theory.json")]),
             ("prepare_data", "encode_batch", ["--dataset", "text", "--path",
                                               str(tmp / "big" / "a.txt"), "--workers", "2",
                                               "--out_dir", str(tmp / "interrupted")]))
    for script, held, argv in cases:
        ready = tmp / f"{script}.ready"
        name = script.rpartition(".")[2]
        code = (f"import sys, time, pathlib; sys.path.insert(0, {str(ROOT)!r}); "
                f"import {script} as m; f = m.{held}\n"
                f"def slow(*a, **k):\n    pathlib.Path({str(ready)!r}).touch(); "
                f"time.sleep(3 if {script == 'prepare_data'} else 60); return f(*a, **k)\n"
                f"m.{held} = slow; m.main({argv!r})")
        proc = start([sys.executable, "-c", code], start_new_session=True)
        wait_for(ready.exists, proc)
        # as a terminal sends it: to the whole group, workers included
        os.killpg(proc.pid, signal.SIGINT)
        err = proc.communicate(timeout=120)[1].strip()
        check(proc.returncode == 130 and err.startswith(f"{name}.py: interrupted (Ctrl-C):")
              and len(err.splitlines()) == 1,
              f"sigint_scripts: {name}.py, one line and status 130",
              f"exit {proc.returncode}: {err}")
    check(not (tmp / "interrupted").exists() and not (tmp / "theory.json").exists(),
          "sigint_scripts: nothing left as a result")


def one_line_refusal(argv, what, **kwargs):
    """Run a command that must be refused: status 1 (make: non-zero) and one line of error."""
    done = subprocess.run(argv, cwd=ROOT, env=kwargs.pop("env", ENV), capture_output=True,
                          text=True, timeout=600, **kwargs)
    err = done.stderr.strip()
    check(done.returncode != 0 and "Traceback" not in err and len(err.splitlines()) <= 2,
          what, f"exit {done.returncode}: {done.stdout[-500:]} {err}")
    return done


def outputs(tmp, data):
    """The data-loss repros of issue 45 (items 7, 8, 9, 11), from the command line: two outputs
    naming one file, a user's file that looks like an image, make gpu-study without CUDA over the
    last run's log, and a report on a results directory that is not the committed one."""
    ckpt = tmp / "base" / "ckpt.pt"
    if not ckpt.exists():
        subprocess.run([sys.executable, "train.py", *tiny_args(data, tmp / "base", max_iters=4)],
                       cwd=ROOT, env=ENV, check=True, capture_output=True)
    out = tmp / "outputs"
    out.mkdir()
    probe = [sys.executable, "study/eval_retrieval.py", "--ckpt", str(ckpt), "--probe",
             "repeat", "--span", "4", "--distances", "0,8", "--sequences", "2"]
    one_line_refusal(probe + ["--json", str(out / "r.png"), "--plot", str(out / "r.png")],
                     "outputs: eval_retrieval.py --json F --plot F refused")
    one_line_refusal([sys.executable, "resolution.py", "--theory", "--json", str(out / "t.png"),
                      "--plot", str(out / "t.png")], "outputs: resolution.py --json F --plot F "
                     "refused")
    check(not any(out.iterdir()), "outputs: nothing written by the refused commands")
    for name, head in (("thesis.pdf", b"%PDF-1.4\n% my thesis"),
                       ("holiday.png", b"\x89PNG\r\n\x1a\n my holiday")):
        (out / name).write_bytes(head)
        one_line_refusal(probe + ["--plot", str(out / name)],
                         f"outputs: --plot {name} (a user's file) refused")
        check((out / name).read_bytes() == head, f"outputs: {name} kept")
    code_data, study_out = tmp / "code_data", tmp / "gpu_study"
    code_data.mkdir()
    (code_data / "meta.json").write_text("{}")
    study_out.mkdir()
    (study_out / "log.txt").write_text("the last run's log\n")
    one_line_refusal(["make", "gpu-study", f"PY={sys.executable}", f"CODE_DATA={code_data}",
                      f"STUDY_OUT={study_out}"], "outputs: make gpu-study without CUDA refused",
                     env=dict(ENV, CUDA_VISIBLE_DEVICES=""))
    check((study_out / "log.txt").read_text() == "the last run's log\n",
          "outputs: make gpu-study without CUDA keeps the last run's log")
    results = tmp / "extension"
    shutil.copytree(ROOT / "results" / "extension", results)
    tables = (results / "tables.md").read_bytes()
    one_line_refusal([sys.executable, "study/reproduce.py", "--report", "--suite", "extension",
                      "--results", str(results), "--runs", str(tmp / "elsewhere"),
                      "--task_runs", str(tmp / "elsewhere")],
                     "outputs: a report whose rows are all another run's refused")
    check((results / "tables.md").read_bytes() == tables,
          "outputs: the refused report keeps tables.md")
    (results / "raw" / "xpos.tasks.json").unlink()
    subprocess.run([sys.executable, "study/reproduce.py", "--report", "--suite", "extension",
                    "--results", str(results)], cwd=ROOT, env=ENV, check=True,
                   capture_output=True)
    suite = json.loads((results / "summary.json").read_text())["task_suite"]["table"]
    check("zero-shot: xpos + BCA" not in suite and "zero-shot: rope + BCA" in suite,
          "outputs: a report reads its own directory's rows alone", str(list(suite)))


def sigint_torchrun(tmp, data):
    import torch
    out = tmp / "sigint_torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "train.py", *tiny_args(data, out, max_iters=400, eval_interval=5, eval_iters=2,
                                  gradient_accumulation_steps=2)]
    # its own process group, which a terminal's Ctrl-C goes to
    proc = start(cmd, start_new_session=True)
    if not wait_for(lambda: (out / "log.jsonl").exists()
                    and any(i >= 12 for i in logged_iters(out)), proc):
        try:  # torchrun and its ranks, if they stalled: communicate() would wait for them
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # they had all ended
            pass
        check(False, "sigint_torchrun: the run ended or stalled before iteration 12",
              proc.communicate()[1])
        return
    os.killpg(proc.pid, signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    saved = torch.load(out / "ckpt.pt", weights_only=True)["iter_num"]
    ours = [line for line in err.splitlines() if line.startswith("train.py:")]
    traced = any(f'{name}", line' in err for name in ("train.py", "train_setup.py",
                                                      "distributed.py"))
    check(len(ours) == 1 and f"(iter {saved}) is kept" in ours[0] and not traced,
          "sigint_torchrun: one line from rank 0, no traceback from train.py", err)


def limited(size):
    """preexec_fn: files may not grow past size bytes; a write past it fails (EFBIG) instead of
    killing the process."""
    def preexec():
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    return preexec


def full(tmp, data):
    out = tmp / "full"
    subprocess.run([sys.executable, "train.py",
                    *tiny_args(data, out, max_iters=4, eval_interval=2)],
                   cwd=ROOT, env=ENV, check=True, capture_output=True)
    before = (out / "ckpt.pt").read_bytes()
    done = subprocess.run([sys.executable, "train.py",
                           *tiny_args(data, out, max_iters=8, eval_interval=2),
                           "--init_from=resume"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          preexec_fn=limited(len(before) // 2))
    err = done.stderr.strip()
    check(done.returncode == 1 and len(err.splitlines()) == 1 and err.startswith("train.py: error:")
          and (out / "ckpt.pt").read_bytes() == before,
          "full: train.py's checkpoint write fails in one line, the "
          "previous checkpoint intact", f"exit {done.returncode}: {err}")
    corpus, dataset = tmp / "full_corpus", tmp / "full_data"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n\n" * 3000)
    prepare = [sys.executable, "prepare_data.py", "--dataset", "files", "--path", str(corpus),
               "--tokenizer", "char", "--out_dir", str(dataset)]
    subprocess.run(prepare, cwd=ROOT, env=ENV, check=True, capture_output=True)
    files = {p.name: p.read_bytes() for p in dataset.iterdir()}
    (corpus / "a.txt").write_text("pack my box with five dozen liquor jugs\n\n" * 6000)
    done = subprocess.run(prepare, cwd=ROOT, env=ENV, capture_output=True, text=True,
                          preexec_fn=limited(100_000))
    err = done.stderr.strip()
    check(done.returncode == 1 and len(err.splitlines()) == 1
          and err.startswith("prepare_data.py: error:")
          and {p.name: p.read_bytes() for p in dataset.iterdir()} == files,
          "full: prepare_data.py's write fails in "
          "one line, the dataset from before intact", f"exit {done.returncode}: {err}")


def prepare_kill(tmp, data):
    sys.path.insert(0, str(ROOT))
    from lexgpt import data as dataset_files
    corpus, out = tmp / "kill_corpus", tmp / "kill_data"
    corpus.mkdir()
    (corpus / "small.txt").write_text("the quick brown fox jumps over the lazy dog\n\n" * 3000)
    prepare = [sys.executable, "prepare_data.py", "--dataset", "text", "--tokenizer", "gpt2",
               "--out_dir", str(out)]
    subprocess.run([*prepare, "--path", str(corpus / "small.txt")], cwd=ROOT, env=ENV, check=True,
                   capture_output=True)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # one line, 128 MB: some 10 s of tokenizing on 2 CPU cores, so that the kill comes long
    # before the commit
    (corpus / "long.txt").write_text("pack my box with five dozen liquor jugs " * 3_200_000)
    proc = start([*prepare, "--path", str(corpus / "long.txt"), "--workers", "2"])
    workers = []
    busy = wait_for(lambda: len(workers) == 2 or workers.extend(
        k for k in children(proc.pid) if k not in workers and "prepare_data" in cmdline(k))
        or False, proc, 120)
    check(busy, "prepare_kill: prepare_data.py starts two workers",
          proc.stderr.read() if proc.poll() else "")
    time.sleep(0.5)  # both tokenizing
    tokenizing = proc.poll() is None and (out / "meta.json").read_bytes() == before["meta.json"]
    proc.kill()
    proc.wait()
    check(tokenizing, "prepare_kill: the kill comes before the run's commit",
          f"exit {proc.returncode}: the run ended or committed first: {proc.stderr.read()}")
    deadline = time.monotonic() + 30
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    check(not any(alive(w) for w in workers), "prepare_kill: its workers die with it",
          " ".join(map(cmdline, workers)))
    try:
        dataset_files.load_meta(out, full=True)
        changed = [name for name, content in before.items() if (out / name).read_bytes() != content]
        found = f"changed: {changed}"
    except Exception as e:  # noqa: BLE001 -- any failure to read it is the finding
        changed, found = True, f"{type(e).__name__}: {e}"
    check(not changed, "prepare_kill: the dataset from before is intact and loads", found)
    done = subprocess.run([*prepare, "--path", str(corpus / "small.txt")], cwd=ROOT, env=ENV,
                          capture_output=True, text=True)
    check(done.returncode == 0 and {p.name for p in out.iterdir()} == set(before),
          "prepare_kill: the next run finishes, the killed run's files gone",
          done.stderr + str(sorted(os.listdir(out))))


def sigterm_keep(tmp, data):
    import torch
    out = tmp / "sigterm"
    args = tiny_args(data, out, max_iters=INTERRUPTED_ITERS, eval_interval=1, eval_iters=1,
                     keep_checkpoints=2)
    for k, proc, err, saved in interrupted("sigterm_keep", out, args, signal.SIGTERM, seed=1):
        numbered = sorted(p.name for p in out.glob("ckpt_*.pt") if p.stem[5:].isdigit())
        check(len(err.splitlines()) == 1 and "Traceback" not in err and "SIGTERM" in err
              and proc.returncode != 0, f"sigterm_keep {k}: one line (iter {saved} saved)",
              f"exit {proc.returncode}: {err}")
        check(len(numbered) <= 2
              and all(torch.load(out / n, weights_only=True)["iter_num"] <= saved
                      for n in numbered),
              f"sigterm_keep {k}: at most 2 numbered checkpoints kept, none past the last",
              str(numbered))


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    attacks = ("race", "orphan", "sigint_study", "sigint", "sigint_eval", "sigint_scripts",
               "outputs", "sigint_torchrun", "full", "prepare_kill", "sigterm_keep")
    p.add_argument("--only", help="comma-separated: " + ", ".join(attacks))
    only = (p.parse_args().only or ",".join(attacks)).split(",")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = words_dataset(tmp)
        for name in attacks:
            if name in only:
                t0 = time.time()
                if name in ("orphan", "sigint_study"):
                    globals()[name](tmp)
                else:
                    globals()[name](tmp, data)
                print(f"     ({name}: {time.time() - t0:.0f} s)", flush=True)
    print("hostile: " + ("all checks held" if not failures
                         else f"{len(failures)} failed: " + "; ".join(failures)))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
