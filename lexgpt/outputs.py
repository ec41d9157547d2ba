"""
The output files the scripts write (JSON, plots): checked before any work, replacing only an
earlier output of ours, and written by one rename, so that a kill never leaves one that reads as
finished.
"""

import errno
import json
import os
import tempfile
from pathlib import Path

from lexgpt.cli import UserError

# Every JSON output carries this field: --json replaces a file only when it is an earlier output
OUTPUT_MARK = {"written_by": "lex-gpt"}


def write_json(path, obj, quiet=False):
    """Write obj (a dict: OUTPUT_MARK is added) as JSON in one atomic rename, so that a kill never
    leaves a partial file that reads as finished."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    if isinstance(obj, dict):
        obj = {**OUTPUT_MARK, **obj}
    partial.write_text(json.dumps(obj, indent=1) + "\n")
    partial.replace(path)
    if not quiet:
        print(f"wrote {path}")


def pyplot():
    """matplotlib's pyplot without a display, or a one-line error when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    return plt


# The formats --plot writes, each with the metadata field that marks a plot as ours (matplotlib's
# metadata= argument) and the bytes that field becomes in the file. A file is an earlier plot only
# when it carries the mark: a user's own figure of the same format is kept.
PLOT_CREATOR = "lex-gpt"
PLOT_MARKS = {
    "png": b"tEXtCreator\x00" + PLOT_CREATOR.encode(),
    "pdf": b"/Creator (" + PLOT_CREATOR.encode() + b")",
    "svg": b"<dc:title>" + PLOT_CREATOR.encode() + b"</dc:title>",
    "eps": b"%%Creator: " + PLOT_CREATOR.encode() + b"\n",
    "ps": b"%%Creator: " + PLOT_CREATOR.encode() + b"\n",
}


def save_plot(fig, path, dpi=120, quiet=True):
    """Save a figure marked as ours (PLOT_MARKS), in one atomic rename like write_json."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    fig.savefig(partial, dpi=dpi, format=path.suffix[1:].lower(),
                metadata={"Creator": PLOT_CREATOR})
    partial.replace(path)
    if not quiet:
        print(f"wrote {path}")


def distinct_outputs(outputs):
    """outputs: (flag, path or None) pairs; a one-line error when two name the same file, which
    the last written would silently replace."""
    seen = {}
    for flag, path in outputs:
        if path is None:
            continue
        key = Path(path).resolve()
        if key in seen:
            raise UserError(f"{seen[key]} and {flag} name the same file {path}: each needs its "
                            "own, or one would replace the other")
        seen[key] = flag


def output_path(path, flag, plot=False):
    """Where --flag writes, checked before any work starts: not a directory, and its folder can be
    created and written. A plot path without a suffix gets .png (matplotlib would add it silently);
    its format must be one matplotlib can write. An existing file is replaced only when it is an
    earlier output of the same kind (earlier_output): --json out/ckpt.pt must not turn a
    checkpoint into JSON."""
    if path is None:
        return None
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory: give a file name")
    if plot and not path.suffix:
        path = path.with_name(path.name + ".png")
    if plot:
        plt = pyplot()
        figure = plt.figure()
        formats = figure.canvas.get_supported_filetypes()
        plt.close(figure)
        if path.suffix[1:].lower() not in formats:
            raise UserError(f"{flag} {path}: matplotlib cannot write {path.suffix} files; use "
                            ".png, .pdf or .svg")
        if path.suffix[1:].lower() not in PLOT_MARKS:
            raise UserError(f"{flag} {path}: {path.suffix} is not allowed: .png, .pdf, .svg, "
                            ".eps or .ps (formats whose metadata marks a plot as ours)")
    if (path.exists() or path.is_symlink()) and not earlier_output(path, plot):
        kind = "plot" if plot else "JSON output"
        raise UserError(f"{flag} {path} exists and is not an earlier {kind} of lex-gpt: refusing "
                        "to replace it; give a new file name, or remove it first")
    # proven writable by writing there, then the folders made for the proof are removed: a
    # command that fails later leaves nothing behind (write_json and save_plot make them again)
    made = [f for f in (path.parent, *path.parent.parents) if not os.path.lexists(f)]
    writable_dir(path.parent, flag)
    for folder in made:  # deepest first
        try:
            folder.rmdir()
        except OSError:  # no longer empty: someone else's now
            break
    return path


def earlier_output(path, plot):
    """Whether the file at path is one this project wrote: JSON carrying OUTPUT_MARK, or a plot
    carrying its format's mark (PLOT_MARKS, written by save_plot). Anything else, a symlink
    included, is not."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        if path.stat().st_size > (1 << 26 if plot else 1 << 30):  # no output of ours is this large
            return False
        if plot:
            mark = PLOT_MARKS.get(path.suffix[1:].lower())
            return mark is not None and mark in path.read_bytes()
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # unreadable, not UTF-8 or not JSON
        return False
    return isinstance(obj, dict) and all(obj.get(k) == v for k, v in OUTPUT_MARK.items())


def writable_dir(folder, what):
    """Create folder if needed and prove it writable with a scratch file, or a one-line error."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except (FileExistsError, NotADirectoryError):
        try:  # mkdir's "exists" also stands for a loop of symbolic links: name the real problem
            os.stat(folder)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UserError(f"{what} {folder}: {e.strerror}") from None
        raise UserError(f"{what} {folder}: it (or a folder above it) is a file, not a directory") \
            from None
    except OSError as e:
        raise UserError(f"{what} {folder} is not writable: {e.strerror}") from None
    return folder
