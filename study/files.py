"""
The files of a results directory (results/<suite>): its raw results kept compact, its
summary.json, and the check that a report writes over nothing it did not write.

The raw results are kept compact (compact_raw): numbers rounded far below the printed
decimals, one row per line, without the per-position curves that no table or plot draws, and
the value most rows share for a field written once (hoisted; jobs.read_result gives
the rows back in full); the scripts run by hand with --json still write them in full.
"""

import json
import math
import os
from collections import Counter
from pathlib import Path

from lexgpt.cli import UserError
from lexgpt.outputs import OUTPUT_MARK, earlier_output
from lexgpt.retrieval_tasks import TASKS
from study.jobs import FINE_TUNES, expanded, read_result

# Compact raw results: the fields dropped (per-position curves that no table or plot reads),
# and the significant digits kept: 10 move a mean over seeds by about 1e-10 of itself, far
# below the 2-3 decimals the tables print, and leave the plots drawn from these files
# unchanged to the pixel (at 7, Figure 2's theory curves already move).
RAW_DROPPED = ("curves", "s_hat", "s_hat_heads", "pairs")
RAW_DIGITS = 10



SUITE_NAMES = {"study": "the study's", "retrieval": "the task suite's",
               "extension": "the context extension's", "control": "the positive control's"}


def suite_of(raw):
    """Which suite's raw results a folder holds, by the files only that suite's jobs write: the
    fine-tunes' perplexity or task probe (extension), the task sweeps or task probes alone
    (retrieval), the perplexity or repeat probe (study), the control's context probe (control);
    None when empty."""
    if (raw / "long.context.json").exists():
        return "control"
    if any((raw / f"{name}.{kind}.json").exists() for name, _, _ in FINE_TUNES
           for kind in ("ppl", "tasks")):
        return "extension"
    if any(raw.glob("*.sweep.json")) or (any(raw.glob("*.tasks.json"))
                                          and not any(raw.glob("*.ppl.json"))):
        return "retrieval"
    if any(raw.glob("*.ppl.json")) or any(raw.glob("*.repeat.json")):
        return "study"
    return None


def check_outputs(results, suite):
    """Before a report writes anything: the results directory holds this suite's raw results,
    not another's, and every file the report writes that is already there is one a report
    wrote (summary.json marked, tables.md with its heading, plots by their signature);
    anything else is refused with one line and kept."""
    raw = results / "raw"
    found = suite_of(raw)
    if found and found != suite:
        option = f"drop --suite {suite}" if found == "study" else f"give --suite {found}"
        raise UserError(f"--results {results} holds {SUITE_NAMES[found]} results (raw/): "
                        f"{option}, or another --results")
    plots = {"study": ["perplexity.png", "effective_context.png"],
             "retrieval": [f"{p}{t}.png" for t in TASKS for p in ("", "sweep_")],
             "extension": [], "control": []}
    for name in ["summary.json", "tables.md", *plots[suite]]:
        path = results / name
        if not (path.exists() or path.is_symlink()) or ours(path):
            continue
        raise UserError(f"{path} exists and is not one a report of reproduce.py wrote: "
                        "refusing to replace it; move it aside, or give another --results")


def ours(path):
    """Whether a report wrote the file: JSON marked, a plot by its signature, tables by its
    heading."""
    if not path.name.endswith(".md"):
        return earlier_output(path, plot=path.name.endswith(".png"))
    if path.is_symlink() or not path.is_file():
        return False
    headings = (b"Study: ", b"Long-range task suite: ", b"Context extension: ",
                b"Context probe, positive control: ")
    return path.read_bytes()[:40].startswith(headings)


def check_raw(results):
    """Every raw result compact (some were put there by hand, or before they were kept
    compact); a damaged one noted, left out of the tables and measured again by the next
    run."""
    for path in sorted((results / "raw").glob("*.json")):
        if read_result(path) is None:
            print(f"note: {path} is damaged, left out of the tables "
                  "(run reproduce.py to measure it again)")
        else:
            compact_raw(path)


def compact_raw(path):
    """Rewrite a job's JSON compact (without RAW_DROPPED, RAW_DIGITS, one row per line),
    keeping its modification time: whether a result is finished, or older than its
    checkpoints, is judged by that time. A compact file is left as it is."""
    path = Path(path)
    text = path.read_text()
    try:
        result = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not JSON ({e}): remove it and run reproduce.py again "
                        "to measure it again") from None
    compact = compact_json(compact_result(result)) + "\n"
    if compact == text:
        return
    stat = path.stat()
    partial = path.with_name(path.name + ".partial")  # one atomic rename, as common.write_json
    partial.write_text(compact)
    os.utime(partial, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    partial.replace(path)


def write_summary(path, summary):
    """summary.json as common.write_json writes it (marked, one atomic rename), one row per
    line (compact_json); returns what the file holds, which the tables show."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(compact_json({**OUTPUT_MARK, **summary}) + "\n")
    partial.replace(path)
    print(f"wrote {path}")
    return json.loads(path.read_text())


def compact_result(result):
    """A job's result as results/<suite>/raw keeps it, from its full form or any earlier
    compact one: rounded and without RAW_DROPPED (compacted), the rows' shared values hoisted.
    Applied twice, it changes nothing more."""
    return hoisted(compacted(expanded(result)))


def hoisted(result):
    """The result with each field's value that more than half of its rows share written once,
    in "row_defaults", and in each row only the fields where it differs, in the row's order.
    The task suite's rows repeat their rule and probe settings: this takes 40% off its files.
    jobs.expanded undoes it. A result without two or more rows, all dicts, or with a
    row_defaults that did not expand (not a dict), is returned as it is."""
    rows = result.get("rows") if isinstance(result, dict) else None
    if not isinstance(rows, list) or len(rows) < 2 or not all(isinstance(r, dict) for r in rows):
        return result
    if "row_defaults" in result:
        return result
    defaults = {}
    for k in sorted(rows[0]):  # sorted: the same defaults from rows in any key order
        if all(k in row for row in rows):  # a field some rows lack has no default
            text, n = Counter(json.dumps(row[k]) for row in rows).most_common(1)[0]
            if 2 * n > len(rows):
                defaults[k] = json.loads(text)
    if not defaults:
        return result
    # compared as JSON text: 1, 1.0 and true are equal in Python, not in the file
    own = [{k: v for k, v in row.items()
            if k not in defaults or json.dumps(v) != json.dumps(defaults[k])} for row in rows]
    compact = {}
    for k, v in result.items():  # the defaults just above the rows
        if k == "rows":
            compact["row_defaults"] = defaults
        compact[k] = own if k == "rows" else v
    return compact


def compacted(value):
    """The value without RAW_DROPPED's fields, its floats rounded to RAW_DIGITS significant
    digits. Applied twice, it changes nothing more."""
    if isinstance(value, dict):
        return {k: compacted(v) for k, v in value.items() if k not in RAW_DROPPED}
    if isinstance(value, list):
        return [compacted(v) for v in value]
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{RAW_DIGITS}g}")
    return value


def flat(value):
    """Whether a value is a JSON leaf or a list of leaves."""
    if isinstance(value, dict):
        return False
    if isinstance(value, list):
        return not any(isinstance(x, (dict, list)) for x in value)
    return True


def compact_json(value, indent=0):
    """JSON with one row per line: a list of numbers, or a dict of numbers and such lists, on
    one line; any other dict or list one item per line."""
    if flat(value) or (isinstance(value, dict) and all(map(flat, value.values()))):
        return json.dumps(value)
    pad = " " * (indent + 1)
    end = "\n" + " " * indent
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(str(k))}: {compact_json(v, indent + 1)}"
                 for k, v in value.items()]
        return "{\n" + ",\n".join(items) + end + "}"
    items = [pad + compact_json(v, indent + 1) for v in value]
    return "[\n" + ",\n".join(items) + end + "]"
