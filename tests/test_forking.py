"""docs/forking.md cannot drift: every definition its tables name exists in the file named beside
it, and its worked example (a patch adding partial RoPE) applies to a clean copy of the repository,
whose new scheme then rotates exactly as its formula says and trains."""

import ast
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "forking.md"


def defined(path: Path) -> set[str]:
    """Every module-level name of a file, and Class.method for its classes' methods."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names |= {f"{node.name}.{n.name}" for n in node.body
                          if isinstance(n, ast.FunctionDef)}
        targets = node.targets if isinstance(node, ast.Assign) else []
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_every_definition_the_page_names_exists():
    rows = re.findall(r"^\| \d+ \| `([\w./]+)` \| ([^|]*) \|", PAGE.read_text(), flags=re.M)
    assert len(rows) >= 15, "the page's tables were not found"
    for file, names in rows:
        have = defined(ROOT / file) if file.endswith(".py") else set()
        for name in re.findall(r"`([\w.]+)`", names):
            assert name in have, f"docs/forking.md: {file} has no {name}"


def patch() -> str:
    return re.search(r"```diff\n(.*?)```", PAGE.read_text(), flags=re.S).group(1)


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    """A clean copy of the repository's tracked files with the page's patch applied."""
    copy = tmp_path_factory.mktemp("fork") / "lex-gpt"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split("\0")
    for name in filter(None, tracked):
        if name.startswith("results/") or not (ROOT / name).is_file():
            continue  # the committed results: not code
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, copy / name)
    (copy / "prope.diff").write_text(patch())
    subprocess.run(["git", "apply", "prope.diff"], cwd=copy, check=True, capture_output=True)
    return copy


@pytest.mark.slow
def test_the_worked_example_applies_rotates_as_its_formula_and_trains(patched, tmp_path):
    # The patched model's plan, against GPT-NeoX's partial rotary by hand: pairs j < d/4 turn by
    # m * base^(-2j/(d/2)), the others not at all.
    code = ("import sys, torch; sys.path.insert(0, '.'); from model import GPTConfig, "
            "AttentionPlan\n"
            "c = GPTConfig(block_size=16, vocab_size=11, n_layer=1, n_head=2, n_embd=32, "
            "pos='prope')\n"
            "p = AttentionPlan(c, 16); torch.save(p.rotation, sys.argv[1])")
    out = tmp_path / "rotation.pt"
    subprocess.run([sys.executable, "-c", code, str(out)], cwd=patched, check=True,
                   capture_output=True)
    rotation = torch.load(out)  # (frame, d/2, 2): cos, sin of each pair's angle
    d = 16
    for m in range(16):
        for j in range(d // 2):
            angle = m * 10000.0 ** (-2 * j / (d / 2)) if j < d // 4 else 0.0
            want = torch.tensor([math.cos(angle), math.sin(angle)])
            torch.testing.assert_close(rotation[m, j], want, rtol=1e-5, atol=1e-5)

    from test_train import words_dataset
    data = words_dataset(tmp_path)
    train = [sys.executable, "train.py", f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}",
             "--pos=prope", "--block_size=16", "--n_layer=1", "--n_head=2", "--n_embd=32",
             "--batch_size=4", "--max_iters=4", "--eval_interval=4", "--eval_iters=1",
             "--device=cpu", "--dtype=float32", "--compile=False"]
    done = subprocess.run(train, cwd=patched, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    evaluate = [sys.executable, "eval_extrapolate.py", "--ckpt", str(tmp_path / "out" / "ckpt.pt"),
                "--data_dir", str(data), "--lengths", "16,32", "--bca", "both", "--device", "cpu"]
    done = subprocess.run(evaluate, cwd=patched, capture_output=True, text=True)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    # the unpatched repository refuses the scheme, in one line
    done = subprocess.run(train, cwd=ROOT, capture_output=True, text=True)
    assert (done.returncode == 1 and "prope" in done.stderr
            and len(done.stderr.strip().splitlines()) == 1)
