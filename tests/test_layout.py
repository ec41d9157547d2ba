"""The house's three tiers, as `ls` shows them and as the imports run: at the top the method
(model.py, alternatives.py) and the scripts a reader runs; the plumbing in lexgpt/; the study in
study/. The scripts and the study use the method and the plumbing, never each other; the plumbing
imports no script and not the study; the method imports nothing of ours but alternatives.py."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHOD = {"model", "alternatives"}
SCRIPTS = {"train", "prepare_data", "eval_extrapolate", "resolution", "sample", "bench"}


def imported(path: Path) -> set[str]:
    """The top-level names of every module a file imports (at any depth of its code)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_the_top_level_is_the_method_and_the_scripts():
    top = {p.stem for p in ROOT.glob("*.py")}
    assert top == METHOD | SCRIPTS, f"top-level .py files: {sorted(top)}"
    assert len(top) <= 9


def test_imports_run_one_way():
    ours = METHOD | SCRIPTS | {"lexgpt", "study"}
    for name in METHOD:
        uses = imported(ROOT / f"{name}.py") & ours
        assert uses <= {"alternatives"}, f"{name}.py imports {sorted(uses)}"
    plumbing = METHOD | {"lexgpt"}
    for path in [ROOT / f"{name}.py" for name in SCRIPTS] + sorted(ROOT.glob("lexgpt/*.py")):
        uses = imported(path) & ours
        assert uses <= plumbing, f"{path.relative_to(ROOT)} imports {sorted(uses - plumbing)}"
    for path in sorted((ROOT / "study").glob("*.py")):
        uses = imported(path) & ours
        assert uses <= plumbing | {"study"}, f"study/{path.name} imports {sorted(uses - plumbing)}"


def test_tests_mirror_the_layout():
    """The plumbing's tests live in tests/lexgpt/, the study's in tests/study/."""
    for folder in ("lexgpt", "study"):
        assert (ROOT / folder).is_dir() and (ROOT / "tests" / folder).is_dir()
        assert list((ROOT / "tests" / folder).glob("test_*.py")), f"tests/{folder}/ holds no tests"
    assert (ROOT / "study" / "README.md").is_file()
