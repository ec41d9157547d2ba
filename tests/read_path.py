"""The method's path as a reader meets it: every line of the repository's own code that one
xPos pass past block_size executes, from the entry into GPT.forward to the first attention
call (F.scaled_dot_product_attention), traced with sys.settrace. tests/test_model.py bounds
it; `python tests/read_path.py` prints it (the README's tour follows its definitions)."""

import os
import sys
from dataclasses import dataclass

import torch
from torch.nn import functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, ROOT)

from model import GPT, GPTConfig  # noqa: E402


def ours(filename: str) -> str | None:
    """The path of a repository .py file relative to the root; None for anything else (the
    venv, the tests, the standard library, torch, code made by exec such as a dataclass's)."""
    path = os.path.abspath(filename)
    if not path.endswith(".py") or not path.startswith(ROOT + os.sep):
        return None
    rel = os.path.relpath(path, ROOT)
    if rel.split(os.sep)[0] in (".venv", "tests"):
        return None
    return rel


@dataclass
class ReadPath:
    """What one forward pass executes of the repository's code: to the first attention call
    (definitions, in the order first entered; unique (file, line) pairs; model.py frames on
    the stack at that call), and over the whole pass."""
    definitions: list[tuple[str, str]]
    lines: set[tuple[str, int]]
    model_depth: int
    owner: dict[tuple[str, int], str]  # (file, line) -> its definition's qualname
    pass_definitions: list[tuple[str, str]]
    pass_lines: set[tuple[str, int]]

    def outside_model(self) -> list[tuple[str, str]]:
        return [d for d in self.definitions if d[0] != "model.py"]


def trace() -> ReadPath:
    """Trace the reference pass: xPos at block_size 64 on a (1, 200) input, in eval mode and
    without gradients (BCA by default past block_size)."""
    torch.manual_seed(0)
    config = GPTConfig(block_size=64, vocab_size=65, n_layer=2, n_head=2, n_embd=32, pos="xpos")
    model = GPT(config).eval()
    idx = torch.randint(0, 65, (1, 200))
    entry = GPT.forward.__code__
    sdpa = F.scaled_dot_product_attention
    state = dict(inside=False, before=True, depth=None, outer=None)
    definitions, lines, pass_definitions, pass_lines = [], set(), [], set()
    owner = {}
    files = {}  # code filename -> its relative path, or None

    def local(frame, event, arg):
        if not state["inside"]:
            return None
        if event == "line":
            where = (files[frame.f_code.co_filename], frame.f_lineno)
            owner[where] = frame.f_code.co_qualname
            pass_lines.add(where)
            if state["before"]:
                lines.add(where)
        elif event == "return" and frame is state["outer"]:
            state["inside"] = False
        return local

    def on_call(frame, event, arg):  # sys.settrace's global function: each new frame
        code = frame.f_code
        if code.co_filename not in files:
            files[code.co_filename] = ours(code.co_filename)
        rel = files[code.co_filename]
        if rel is None:
            return None
        if code is entry and not state["inside"] and state["outer"] is None:
            state["inside"], state["outer"] = True, frame
        if not state["inside"]:
            return None
        definition = (rel, code.co_qualname)
        if definition not in pass_definitions:
            pass_definitions.append(definition)
        if state["before"] and definition not in definitions:
            definitions.append(definition)
        return local

    def on_profile(frame, event, arg):  # sys.setprofile's: a C function's call
        if event == "c_call" and arg is sdpa and state["inside"] and state["before"]:
            state["before"] = False
            depth, f = 0, frame
            while f is not None:
                depth += files.get(f.f_code.co_filename) == "model.py"
                f = f.f_back
            state["depth"] = depth

    tracer, profiler = sys.gettrace(), sys.getprofile()  # a debugger's or coverage's
    with torch.no_grad():
        sys.settrace(on_call)
        sys.setprofile(on_profile)
        try:
            model(idx)
        finally:
            sys.setprofile(profiler)
            sys.settrace(tracer)
    assert not state["before"], "the pass never called F.scaled_dot_product_attention"
    return ReadPath(definitions, lines, state["depth"], owner, pass_definitions, pass_lines)


def main() -> None:
    path = trace()
    print(f"GPT.forward -> first F.scaled_dot_product_attention: {len(path.lines)} unique lines, "
          f"{len(path.definitions)} definitions, {len(path.outside_model())} outside model.py, "
          f"model.py depth {path.model_depth}")
    for rel, name in path.definitions:
        n = sum(1 for where in path.lines if where[0] == rel and path.owner[where] == name)
        print(f"  {rel}: {name} ({n} lines)")
    print(f"whole pass: {len(path.pass_lines)} unique lines, "
          f"{len(path.pass_definitions)} definitions")


if __name__ == "__main__":
    main()
