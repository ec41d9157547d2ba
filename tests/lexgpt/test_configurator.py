"""Tests for configurator.py: defaults, config files and --key=value applied in order,
and one-line errors."""

import pytest

from lexgpt.cli import UserError
from lexgpt.configurator import AT_LEAST_ONE, FRACTION, POSITIVE, configure

DEFAULTS = dict(name="run", n_layer=6, lr=1e-3, flag=False, mode="a")
CHOICES = dict(mode=("a", "b"))
LIMITS = dict(lr=POSITIVE, n_layer=AT_LEAST_ONE)


def config(tmp_path, *argv, **files):
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
    return configure(DEFAULTS, [a.format(tmp=tmp_path) for a in argv], CHOICES, LIMITS)


def error(tmp_path, *argv, **files):
    with pytest.raises(UserError) as e:
        config(tmp_path, *argv, **files)
    return str(e.value)


def test_files_then_flags_in_order(tmp_path):
    c = config(tmp_path, "{tmp}/a.py", "--n_layer=3", "{tmp}/b.py", "--flag=True",
               a="import math\n_scratch = 1\nn_layer = 2\nlr = 1\n", b="n_layer = 4\nmode = 'b'\n")
    # an int is taken for a float
    assert c == dict(name="run", n_layer=4, lr=1.0, flag=True, mode="b")
    assert type(c["lr"]) is float and DEFAULTS["n_layer"] == 6  # the defaults are not touched
    assert config(tmp_path, "--flag=false", "--lr=2e-3", "--name=x")["flag"] is False


@pytest.mark.parametrize("argv,files,message", [
    (["--nope=1"], {},
     "unknown config key 'nope' (from --nope=1); known keys: name, n_layer, lr, flag, mode"),
    (["{tmp}/a.py"], dict(a="nope = 1\n"), "unknown config key 'nope' (from "),
    (["--n_layer=two"], {}, "config key n_layer='two' (from --n_layer=two) must be a int"),
    (["--flag=yes"], {}, "config key flag='yes' (from --flag=yes) must be a bool"),
    (["{tmp}/a.py"], dict(a="n_layer = 4.5\n"), "config key n_layer=4.5 (from "),
    (["{tmp}/a.py"], dict(a="lr = None\n"), "config key lr=None (from "),
    (["--mode=c"], {}, "config key mode='c' (from --mode=c) must be one of a, b"),
    (["--lr=0"], {}, "config key lr=0.0 is not allowed: must be a finite number > 0"),
    (["--lr=inf"], {}, "config key lr=inf is not allowed: must be a finite number > 0"),
    (["--n_layer=0"], {}, "config key n_layer=0 is not allowed: must be an integer >= 1"),
    (["--n_layer"], {}, "expected --key=value, got '--n_layer'"),
    (["{tmp}/none.py"], {}, "does not exist"),
    (["{tmp}/a.py"], dict(a="def f():\n    return 1 / 0\nn_layer = f()\n"),
     "a.py, line 2: ZeroDivisionError"),
])
def test_errors_name_the_key_or_the_line(tmp_path, argv, files, message):
    assert message in error(tmp_path, *argv, **files)


def test_a_limit_is_checked_on_the_final_value(tmp_path):
    assert config(tmp_path, "--lr=-1", "--lr=0.5")["lr"] == 0.5
    assert FRACTION[0](0.0) and not FRACTION[0](1.0) and not FRACTION[0](float("nan"))


def test_an_unreadable_config_file_is_one_line(tmp_path, monkeypatch):
    import pathlib
    (tmp_path / "a.py").write_text("n_layer = 2\n")

    def refuse(self):  # a file mode 000 (root reads through it)
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(pathlib.Path, "read_bytes", refuse)
    assert (error(tmp_path, "{tmp}/a.py")
            == f"config file {tmp_path}/a.py is not readable: Permission denied")
    monkeypatch.undo()
    assert "is not readable: File name too long" in error(tmp_path, "{tmp}/" + "x" * 300 + ".py")


def test_seed_limit():
    from lexgpt.configurator import SEED
    assert "seed=-1 is not allowed" in str(pytest.raises(UserError, configure, dict(seed=1),
                                                         ["--seed=-1"], None,
                                                         dict(seed=SEED)).value)
    assert configure(dict(seed=1), ["--seed=7"], None, dict(seed=SEED))["seed"] == 7


@pytest.mark.parametrize("seed", [-1, 0, 7, 2**63 - 1, 2**63, 10**23])
def test_the_seed_key_and_the_seed_flag_share_one_rule(seed):
    """train.py's seed key and the scripts' --seed take the seeds numpy (none negative) and torch
    (none >= 2^64) both take, with room for seed + rank: 0 .. 2^63 - 1, one rule."""
    from lexgpt.cli import check_seed
    from lexgpt.configurator import SEED
    allowed = 0 <= seed < 2**63
    try:
        check_seed(seed)
        flag = True
    except UserError as e:
        flag = False
        assert str(e) == f"--seed {seed} is not allowed: must be an integer from 0 to 2**63 - 1"
    try:
        configure(dict(seed=1), [f"--seed={seed}"], None, dict(seed=SEED))
        key = True
    except UserError as e:
        key = False
        assert str(e) == (f"config key seed={seed} is not allowed: must be an integer from 0 to "
                          "2**63 - 1 (numpy takes no negative seed, torch none >= 2**64)")
    assert flag == key == allowed


def test_the_keys_set_are_reported(tmp_path):
    """given collects the keys a config file or --key=value set, even to their default: what the
    user chose, apart from the defaults (issue 45, item 22)."""
    given = set()
    (tmp_path / "a.py").write_text("n_layer = 6\n_private = 1\nimport math\n")
    configure(DEFAULTS, [f"{tmp_path}/a.py", "--flag=True"], CHOICES, LIMITS, given=given)
    assert given == {"n_layer", "flag"}
