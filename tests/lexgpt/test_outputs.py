"""Tests for lexgpt/outputs.py: a plot or JSON output replaces only a file this project wrote, and
two outputs of one command never name the same file."""

import pytest

from lexgpt import outputs
from lexgpt.cli import UserError


def error(f, *args, **kw):
    with pytest.raises(UserError) as e:
        f(*args, **kw)
    return str(e.value)


@pytest.mark.parametrize("name, head", [("thesis.pdf", b"%PDF-1.4\n% my thesis\n"),
                                        ("holiday.png", b"\x89PNG\r\n\x1a\n my holiday"),
                                        ("figure.svg", b"<?xml version='1.0'?><svg>mine</svg>"),
                                        ("poster.eps", b"%!PS-Adobe-3.0 EPSF-3.0\n")])
def test_a_file_that_only_looks_like_an_image_is_kept(tmp_path, name, head):
    """Issue 45 item 8: a user's file whose first bytes are its format's signature used to count as
    an earlier plot and was replaced."""
    (tmp_path / name).write_bytes(head)
    assert "is not an earlier plot" in error(outputs.output_path, tmp_path / name, "--plot",
                                             plot=True)
    assert (tmp_path / name).read_bytes() == head


@pytest.mark.parametrize("suffix", ["png", "pdf", "svg", "eps", "ps"])
def test_only_a_plot_save_plot_wrote_is_an_earlier_plot(tmp_path, suffix):
    plt = outputs.pyplot()
    fig = plt.figure()
    fig.gca().plot([1, 2, 3])
    fig.savefig(tmp_path / f"theirs.{suffix}")  # matplotlib's own figure, as a user saves it
    outputs.save_plot(fig, tmp_path / f"ours.{suffix}")
    plt.close(fig)
    assert (tmp_path / f"ours.{suffix}").read_bytes()[:2] == \
        (tmp_path / f"theirs.{suffix}").read_bytes()[:2]  # the same format
    assert not list(tmp_path.glob("*.partial"))
    path = outputs.output_path(tmp_path / f"ours.{suffix}", "--plot", plot=True)
    assert path == tmp_path / f"ours.{suffix}"
    assert "is not an earlier plot" in error(outputs.output_path, tmp_path / f"theirs.{suffix}",
                                             "--plot", plot=True)


def test_plot_formats_that_cannot_carry_the_mark_are_refused(tmp_path):
    for suffix in ("jpg", "tif", "webp"):
        message = error(outputs.output_path, tmp_path / f"p.{suffix}", "--plot", plot=True)
        assert f"--plot {tmp_path / f'p.{suffix}'}: .{suffix} is not allowed: .png, .pdf" in message
    assert "matplotlib cannot write .xyz" in error(outputs.output_path, tmp_path / "p.xyz",
                                                   "--plot", plot=True)


def test_two_outputs_naming_one_file_are_refused(tmp_path):
    """Issue 45 item 7: --json F --plot F wrote one over the other."""
    f = tmp_path / "r.png"
    assert (f"--json and --plot name the same file {f}" in
            error(outputs.distinct_outputs, [("--json", f), ("--plot", None), ("--plot", f)]))
    # the same file by another spelling
    (tmp_path / "sub").mkdir()
    other = tmp_path / "sub" / ".." / f.name
    message = error(outputs.distinct_outputs, [("--json", f), ("--plot", other)])
    assert "name the same file" in message
    outputs.distinct_outputs([("--json", tmp_path / "r.json"), ("--plot", f), ("--x", None)])


def test_a_failed_command_leaves_no_folder_behind(tmp_path):
    """Issue 45 item 24: make gpu-bench left an empty out/bench/ when it failed: output_path
    proves the folder writable, then removes what it made; the write makes it again."""
    path = outputs.output_path(tmp_path / "out" / "bench" / "gpu.json", "--json")
    assert path == tmp_path / "out" / "bench" / "gpu.json" and not (tmp_path / "out").exists()
    outputs.write_json(path, {"rows": []}, quiet=True)
    assert path.is_file()
    plot = outputs.output_path(tmp_path / "plots" / "p", "--plot", plot=True)
    assert plot == tmp_path / "plots" / "p.png" and not (tmp_path / "plots").exists()
    (tmp_path / "kept").mkdir()  # a folder that was there stays
    outputs.output_path(tmp_path / "kept" / "r.json", "--json")
    assert (tmp_path / "kept").is_dir()


def test_bench_without_cuda_writes_nothing(tmp_path):
    import bench

    with pytest.raises(SystemExit) as e:
        bench.main(["--only", "gpu", "--device", "cpu", "--json", str(tmp_path / "b" / "g.json")])
    assert "--only gpu needs a CUDA device" in str(e.value.code)
    assert list(tmp_path.iterdir()) == []
