"""
train.py's configuration, read the way nanoGPT's configurator.py reads it, so that its config files
and command lines work here unchanged:

    python train.py config/shakespeare_char.py --pos=rope --max_iters=500

The defaults, then each config file in order (plain Python assignments), then each --key=value.
Unlike nanoGPT's, every key is checked before any work, so that a typo cannot train for hours on a
default: an unknown key, a value of the wrong type, a value outside its choices or its range, or a
config file that fails to run, stops with a one-line error naming the key (or the file and line),
not a traceback.
"""

import math
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Callable

from lexgpt.cli import SEED_RULE, UserError, is_seed


def in_range(low: float, high: float = math.inf) -> Callable[[float], bool]:
    """A range check: finite, low <= v < high (NaN fails every comparison)."""

    def check(v):
        return math.isfinite(v) and low <= v < high

    return check


def positive(v: float) -> bool:
    return in_range(0)(v) and v > 0


def at_least_zero(v: int) -> bool:
    return v >= 0


def at_least_one(v: int) -> bool:
    return v >= 1


# (check, what it allows) pairs for limits
POSITIVE = (positive, "a finite number > 0")
NON_NEGATIVE = (in_range(0), "a finite number >= 0")
FRACTION = (in_range(0, 1), "in [0, 1)")
COUNT = (at_least_zero, "an integer >= 0")
AT_LEAST_ONE = (at_least_one, "an integer >= 1")
# cli's seed rule (--seed's too); set_key has made the value an int by now
SEED = (is_seed, f"{SEED_RULE} (numpy takes no negative seed, torch none >= 2**64)")


def configure(defaults, argv, choices=None, limits=None, given=None):
    """The configuration dict: defaults, then argv's config files and --key=value in order.
    choices: key -> allowed values; limits: key -> (check, what it allows), checked once the whole
    configuration is known. given, a set: gets the keys argv set (to their default too), the
    user's choices as against the defaults."""
    config = dict(defaults)
    given = set() if given is None else given
    for arg in argv:
        if arg.startswith("--"):
            key, eq, value = arg[2:].partition("=")
            if not eq:
                raise UserError(f"expected --key=value, got {arg!r}")
            set_key(config, defaults, choices or {}, key, value, arg)
            given.add(key)
        else:
            for key, value in run_config_file(arg).items():
                if not key.startswith("_") and not isinstance(value, ModuleType):
                    set_key(config, defaults, choices or {}, key, value, arg)
                    given.add(key)
    for key, (ok, allowed) in (limits or {}).items():
        if not ok(config[key]):
            raise UserError(
                f"config key {key}={config[key]!r} is not allowed: must be {allowed}"
            )
    return config


def set_key(config, defaults, choices, key, value, source):
    """config[key] = value, checked: a known key, and a value of its default's type (a command-line
    string is parsed as one; an int is taken for a float), one of its choices if it has them."""
    if key not in defaults:
        raise UserError(
            f"unknown config key {key!r} (from {source}); known keys: {', '.join(defaults)}"
        )
    want = type(defaults[key])
    # from the command line: parse by the default's type
    if isinstance(value, str) and want is not str:
        try:
            if want is bool:
                value = {"true": True, "false": False}[value.lower()]
            else:
                value = want(value)
        except (KeyError, ValueError):
            raise UserError(
                f"config key {key}={value!r} (from {source}) must be a {want.__name__}"
            ) from None
    if want is float and type(value) is int:
        value = float(value)
    if type(value) is not want:
        raise UserError(f"config key {key}={value!r} (from {source}) must be a {want.__name__}")
    if key in choices and value not in choices[key]:
        raise UserError(
            f"config key {key}={value!r} (from {source}) must be one of {', '.join(choices[key])}"
        )
    config[key] = value


def run_config_file(path):
    """A config file's assignments; any error in it is reported as one line naming the file and
    the line."""
    try:
        if Path(path).is_dir():
            raise UserError(f"config file {path!r} is a directory, not a file")
        if not Path(path).is_file():
            raise UserError(f"config file {path!r} does not exist")
        data = Path(path).read_bytes()
    except OSError as e:  # permissions, a name too long, an I/O error
        raise UserError(f"config file {path} is not readable: {e.strerror}") from None
    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UserError(
            f"config file {path}, line {line}: byte 0x{data[e.start]:02x} is not UTF-8 text"
        ) from None
    namespace = {}
    try:
        exec(compile(source, path, "exec"), namespace)
    except SyntaxError as e:
        raise UserError(f"config file {e.filename}, line {e.lineno}: {e.msg}") from None
    except Exception as e:  # the deepest frame in a config file, not in Python or its packages
        not_config = ("<", sys.prefix, sys.base_prefix, __file__)
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if not f.filename.startswith(not_config)]
        where = f"{frames[-1].filename}, line {frames[-1].lineno}" if frames else path
        raise UserError(f"config file {where}: {type(e).__name__}: {e}") from None
    return namespace


def key_help(config_class):
    """Lines describing a configuration dataclass's keys, read from its source so that they cannot
    drift from it: each key as --key=default with the comment beside it, under the comments that
    stand alone on their lines (its sections' headings)."""
    import inspect
    import io
    import tokenize
    from dataclasses import MISSING, fields

    source = inspect.getsource(config_class)
    lines = source.splitlines()
    comments = {}  # line number -> the comment on it, without the '#'
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string[1:].strip()
    defaults = {f.name: f.default for f in fields(config_class) if f.default is not MISSING}
    keys, out = [], []
    for number, line in enumerate(lines, 1):
        name = line.strip().partition(":")[0]
        if name in defaults:
            keys.append((f"--{name}={defaults[name]}", comments.get(number, "")))
        elif number in comments and line.strip().startswith("#"):
            keys.append((None, comments[number]))
    width = max(len(shown) for shown, _ in keys if shown) + 2
    for shown, meaning in keys:
        if shown is None:
            out += ["", meaning]
        else:
            out.append(f"  {shown:<{width}}{meaning}")
    return out
