"""The documentation's commands run as written: every command in the bash blocks of README.md and of
every page in docs/ is either run here (the README first, then the pages in alphabetical order, each
page's commands in order; training shortened to 2 iterations, the probes to 2 sequences), or
listed below with the reason it cannot run on a CPU machine without a network, so the
documentation cannot drift from the code again. Every relative link of those pages resolves."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("prepare_data.py", "train.py", "eval_extrapolate.py", "resolution.py", "sample.py",
           "study/eval_retrieval.py", "study/reproduce.py")
NOT_RUN = {  # a substring of the command (or its end, marked $) -> why the test does not run it
    "make ": "make test and make test-all run the suites; make demo and make passkey take minutes; "
             "make gpu-check and make gpu-retrieval need a GPU; "
             "make code-data tokenizes the whole virtualenv",
    "pip install": "installs packages",
    "git apply": "changes the code: "
                 "tests/test_forking.py applies docs/forking.md's patch to a copy",
    "prope": "needs docs/forking.md's patch: "
             "tests/test_forking.py applies it and runs these on a copy",
    "--nproc_per_node=8": "needs 8 GPUs",
    "--nnodes=2": "needs two machines",
    "--dataset url": "needs the network",
    "--dataset tiny_shakespeare": "needs the network",
    "--device cuda": "needs a GPU",
    "bench.py": "a benchmark, minutes long (tests/test_bench.py runs it at a tiny scale)",
    "[": "a usage synopsis with placeholders",
    "python study/reproduce.py$": "the whole study takes hours "
                                  "(tests/study/test_reproduce.py runs it on a toy budget)",
    "reproduce.py --suite retrieval$": "the whole task suite takes hours (tests/study/"
                                       "test_retrieval_tasks.py runs it on a toy budget)",
    "reproduce.py --suite extension$": "fine-tunes nine models and scores fifteen: an hour "
                                       "(tests/study/test_reproduce.py runs it on a toy budget)",
    "--runs out/retrieval_rerun": "trains the task suite's rope, xpos and xpos_4layer again and "
                                  "sweeps them: hours (tests/study/test_retrieval_tasks.py runs "
                                  "the suite on a toy budget)",
    "--budget toy": "a minute or two (tests/study/test_reproduce.py runs it)",
    "reproduce.py --tune": "half an hour of training "
                           "(tests/study/test_reproduce.py runs it on a toy budget)",
}
SHORTEN_TRAINING = ["--max_iters=2", "--eval_iters=1"]
# the probes' sequences (the last of a flag given twice counts): a model trained 2 iterations
# scores the same at 2 as at 32, and the task probe's commands took 5 of the test's 7 minutes
SHORTEN_PROBES = ["--sequences", "2"]


def pages():
    """README.md first, then study/README.md, then every page of docs/ in alphabetical order: the
    order their commands run in."""
    return [ROOT / "README.md", ROOT / "study" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def page_commands(page):
    """Every command in the page's ```bash blocks, in order (continuation lines joined,
    comments dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    commands = [shlex.split(line, comments=True) for line in lines]
    return [c for c in commands if c]


def all_commands():
    """(page name, command) for every command of every page, in the order they run."""
    return [(page.relative_to(ROOT).as_posix(), c) for page in pages() for c in page_commands(page)]


def skip_reason(command):
    line = " ".join(command)
    return next((why for key, why in NOT_RUN.items()
                 if (line.endswith(key[:-1]) if key.endswith("$") else key in line)), None)


def argv_for(command):
    """The command with this interpreter and the repository's scripts by absolute path."""
    if command[0] == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
    elif command[0] == "python":
        command = [sys.executable, *command[1:]]
    else:
        raise AssertionError(f"command neither run nor listed in NOT_RUN: {' '.join(command)}")
    argv = [str(ROOT / a) if a in SCRIPTS else a for a in command]
    if "study/eval_retrieval.py" in command:
        return argv + SHORTEN_PROBES
    return argv + SHORTEN_TRAINING if "train.py" in command else argv


def test_every_command_is_run_or_excused():
    commands = [c for _, c in all_commands()]
    assert len(commands) > 15
    assert page_commands(ROOT / "README.md"), "the README has commands of its own"
    run = [c for c in commands if skip_reason(c) is None]
    # every script has a runnable line
    assert {c[1] for c in run if c[0] == "python"} == set(SCRIPTS)
    for c in run:
        argv_for(c)


def test_relative_links_resolve_and_every_page_is_linked_from_the_readme():
    """A moved page or figure breaks no link: every relative link (and image) of every page points
    at a file that exists, relative to the page; and the README links every page of docs/."""
    for page in pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor within the page
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)}: the link {target} points at nothing"
    readme = (ROOT / "README.md").read_text()
    for page in pages()[1:]:
        assert (f"]({page.relative_to(ROOT).as_posix()})"
                in readme), f"the README does not link {page.name}"


@pytest.mark.slow
def test_commands_run_in_order(tmp_path):
    """Every runnable command, the README's first, then each page's top to bottom, in one working
    directory as a user has it (config/, a folder of text): a page's commands may use what the
    README's quick start made (its checkpoints), and a command that trips over what an earlier one
    left (an existing checkpoint) fails here too."""
    (tmp_path / "config").symlink_to(ROOT / "config")
    (tmp_path / "corpus" / "part").mkdir(parents=True)
    for i in range(4):
        (tmp_path / "corpus" / "part" / f"{i}.txt").write_text(f"Chapter {i}.\n"
                                                               + "It was a dark night. " * 50)
    # the other inputs the data page names: JSON lines, one big file, nanoGPT's .bin
    (tmp_path / "dump").mkdir()
    for i in range(2):
        (tmp_path / "dump" / f"{i}.jsonl").write_text("".join(
            json.dumps({"text": f"Story {i}.{j}. " + "Once upon a time. " * 40}) + "\n"
            for j in range(5)))
    parts = [f"Part {i}.\n" + "The end is near. " * 60 for i in range(8)]
    (tmp_path / "big.txt").write_text("\n<|endoftext|>\n".join(parts))
    bins = tmp_path / "nanoGPT" / "data" / "openwebtext"
    bins.mkdir(parents=True)
    for split, n_docs in (("train", 12), ("val", 3)):
        docs = [np.append(np.random.default_rng([i, n_docs]).integers(0, 50000, 300), 50256)
                for i in range(n_docs)]
        np.concatenate(docs).astype(np.uint16).tofile(bins / f"{split}.bin")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for page, command in [(p, c) for p, c in all_commands() if skip_reason(c) is None]:
        result = subprocess.run(argv_for(command), cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0, f"{page}: {' '.join(command)}\n{result.stderr[-2000:]}"
        assert ("Traceback"
                not in result.stderr), f"{page}: {' '.join(command)}\n{result.stderr[-2000:]}"


def test_the_tour_of_model_py_is_the_traced_read_path():
    """The README's tour is what `python tests/tour.py` writes from the trace (tests/read_path.py):
    the definitions an xPos pass past block_size (so under BCA) runs before its first attention
    call, in order, and the trace's numbers. It names definitions, not lines: moving code in
    model.py keeps it current."""
    import tour
    have, want = tour.current((ROOT / "README.md").read_text())
    assert have == want, "the README's tour is not the traced path: run python tests/tour.py"
    assert tour.TO_DESCRIBE not in have, "a definition of the tour is not described"
