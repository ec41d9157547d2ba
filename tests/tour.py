"""The README's tour of model.py, written from the trace (tests/read_path.py), so
that it cannot drift:

    python tests/tour.py           # rewrite the tour between its markers in README.md
    python tests/tour.py --check   # exit 1 if the README's tour is not what the trace gives

The tour names definitions, never line numbers: moving code in model.py leaves it current. Each
row's description is kept from the README by the definition's name; a definition new to the path
gets a placeholder, and the command fails until someone describes it.
tests/test_readme.py runs the check.
"""

import re
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]
import read_path  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
START = ("<!-- tour: written by `python tests/tour.py` from the trace; do not edit the names or "
         "numbers -->")
END = "<!-- /tour -->"
ROW = re.compile(r"^\| \d+ \| \[`([\w.]+)`\]\(([\w./]+)\) \| (.*) \|$", flags=re.M)
TO_DESCRIBE = "(to describe)"


def described(text: str) -> dict[str, str]:
    """What the README says of each definition of its tour now, by (file, name)."""
    return {(file, name): what for name, file, what in ROW.findall(text)}


def tour(text: str) -> str:
    """The tour block for README text `text`: the traced definitions in order, the descriptions
    kept, and the numbers of the trace."""
    path = read_path.trace()
    said = described(text)
    rows = ["| step | definition | what it does |", "|---|---|---|"]
    for i, (file, name) in enumerate(path.definitions, 1):
        rows.append(f"| {i} | [`{name}`]({file}) | {said.get((file, name), TO_DESCRIBE)} |")
    outside = path.outside_model()
    elsewhere = "none" if not outside else ", ".join(f"`{f}: {n}`" for f, n in outside)
    numbers = ("Traced from `GPT.forward` to the first attention call (xPos at block_size 64 on "
               f"200 tokens, so under BCA): {len(path.lines)} unique lines in "
               f"{len(path.definitions)} definitions, {len(outside)} of them outside model.py "
               f"({elsewhere}), at model.py call depth {path.model_depth}; the whole pass runs "
               f"{len(path.pass_lines)} unique lines in {len(path.pass_definitions)} definitions.")
    return "\n".join([START, *rows, "", numbers, END])


def current(text: str) -> tuple[str, str]:
    """(the README's tour block, the block the trace gives)."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"tour.py: error: README.md has no tour between {START!r} and {END!r}")
    return text[start : end + len(END)], tour(text)


def main(argv: list[str]) -> None:
    text = README.read_text()
    have, want = current(text)
    if "--check" in argv:
        if have != want:
            raise SystemExit("tour.py: the README's tour is not the traced path: run python "
                             "tests/tour.py")
        return
    README.write_text(text.replace(have, want))
    if TO_DESCRIBE in want:
        raise SystemExit(f"tour.py: error: describe the rows marked {TO_DESCRIBE} in README.md")


if __name__ == "__main__":
    main(sys.argv[1:])
