"""The README's commands run as written: every command in its bash blocks is either run here, in README order
(training shortened to 2 iterations), or listed below with the reason it cannot run on a CPU machine without a
network, so the README cannot drift from the code again."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("prepare_data.py", "train.py", "eval_extrapolate.py", "eval_retrieval.py", "resolution.py", "sample.py",
           "reproduce.py")
NOT_RUN = {  # a substring of the command (or its end, marked $) -> why the test does not run it
    "make ": "make test is this suite; make demo and make passkey take minutes",
    "pip install": "installs packages",
    "--nproc_per_node=8": "needs 8 GPUs",
    "--nnodes=2": "needs two machines",
    "--dataset url": "needs the network",
    "--dataset tiny_shakespeare": "needs the network",
    "--device cuda": "needs a GPU",
    "bench.py": "a benchmark, minutes long (tests/test_bench.py runs it at a tiny scale)",
    "[": "a usage synopsis with placeholders",
    "python reproduce.py$": "the whole study takes hours (tests/test_reproduce.py runs it on a toy budget)",
    "--budget toy": "a minute or two (tests/test_reproduce.py runs it)",
    "reproduce.py --tune": "half an hour of training (tests/test_reproduce.py runs it on a toy budget)",
}
SHORTEN_TRAINING = ["--max_iters=2", "--eval_iters=1"]


def readme_blocks():
    """Each ```bash block of the README as a list of commands (continuation lines joined, comments dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    out = []
    for block in blocks:
        text = block.replace("\\\n", " ")
        commands = [shlex.split(line, comments=True) for line in text.splitlines()]
        out.append([c for c in commands if c])
    return out


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
        raise AssertionError(f"README command neither run nor listed in NOT_RUN: {' '.join(command)}")
    argv = [str(ROOT / a) if a in SCRIPTS else a for a in command]
    return argv + SHORTEN_TRAINING if "train.py" in command else argv


def test_every_readme_command_is_run_or_excused():
    commands = [c for block in readme_blocks() for c in block]
    assert len(commands) > 15
    run = [c for c in commands if skip_reason(c) is None]
    assert {Path(c[1]).name for c in run if c[0] == "python"} == set(SCRIPTS)  # every script has a runnable line
    for c in run:
        argv_for(c)


def test_readme_commands_run_in_order(tmp_path):
    """Every runnable command, top to bottom, in one working directory as a user has it (config/, a folder of text):
    a command that trips over what an earlier one left (an existing checkpoint) fails here too."""
    (tmp_path / "config").symlink_to(ROOT / "config")
    (tmp_path / "corpus" / "part").mkdir(parents=True)
    for i in range(4):
        (tmp_path / "corpus" / "part" / f"{i}.txt").write_text(f"Chapter {i}.\n" + "It was a dark night. " * 50)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for command in [c for block in readme_blocks() for c in block if skip_reason(c) is None]:
        result = subprocess.run(argv_for(command), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-2000:]}"
        assert "Traceback" not in result.stderr, f"{' '.join(command)}\n{result.stderr[-2000:]}"
