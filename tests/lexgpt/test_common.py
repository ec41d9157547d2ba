"""Tests for the shared helper modules: checkpoints checked on load (checkpoint.py), devices and
torchrun (distributed.py), one-line errors (cli.py), output paths (outputs.py), run directories
(run_dir.py), MFU (mfu.py)."""

import importlib
import os

import pytest
import torch

from conftest import make_checkpoint
from lexgpt import checkpoint, cli, distributed, mfu, outputs, run_dir
from test_data import dataset, error


def test_checkpoint_errors(tmp_path):
    data = dataset(tmp_path / "a")
    make_checkpoint(tmp_path / "m.pt", data)
    good = torch.load(tmp_path / "m.pt", weights_only=True)
    cases = {
        "no_config": ({k: v for k, v in good.items() if k != "config"}, "no config"),
        "bad_args": (dict(good, model_args=dict(good["model_args"], n_head=3)),
                     "unusable model_args"),
        "unknown_arg": (dict(good, model_args=dict(good["model_args"], width=3)),
                        "unusable model_args"),
        "wrong_size": (dict(good, model_args=dict(good["model_args"], n_embd=32)),
                       "weights do not fit"),
    }
    for name, (ckpt, message) in cases.items():
        torch.save(ckpt, tmp_path / f"{name}.pt")
        assert message in error(checkpoint.load_model, tmp_path / f"{name}.pt")


def test_sinusoidal_checkpoint_from_before_the_input_scale_is_refused(tmp_path):
    data = dataset(tmp_path / "a")
    make_checkpoint(tmp_path / "new.pt", data, pos="sinusoidal")
    checkpoint.load_model(tmp_path / "new.pt")
    old = torch.load(tmp_path / "new.pt", weights_only=True)
    del old["format"]
    torch.save(old, tmp_path / "old.pt")
    assert ("from before token embeddings were scaled"
            in error(checkpoint.load_model, tmp_path / "old.pt"))
    make_checkpoint(tmp_path / "rope.pt", data, pos="rope")
    rope = torch.load(tmp_path / "rope.pt", weights_only=True)
    del rope["format"]
    torch.save(rope, tmp_path / "old_rope.pt")
    checkpoint.load_model(tmp_path / "old_rope.pt")  # other schemes did not change


@pytest.mark.parametrize("device,message", [("bogus", "device='bogus' is not allowed"),
                                            ("tpu", "device='tpu' is not allowed"),
                                            ("cuda:7", "device='cuda:7' but")])
def test_bad_devices(device, message):
    assert message in error(distributed.resolve_device, device)


def test_output_paths(tmp_path):
    assert outputs.output_path(tmp_path / "new" / "r.json", "--json") == tmp_path / "new" / "r.json"
    # proven writable, then the folder made for the proof removed: write_json makes it again
    assert not (tmp_path / "new").exists()
    assert outputs.output_path(tmp_path / "plot", "--plot", plot=True) == tmp_path / "plot.png"
    assert "is a directory" in error(outputs.output_path, tmp_path, "--json")
    (tmp_path / "file").write_text("")
    assert "is a file, not a directory" in error(outputs.output_path, tmp_path / "file" / "r.json",
                                                 "--json")
    assert "cannot write .xyz" in error(outputs.output_path, tmp_path / "p.xyz",
                                        "--plot", plot=True)


def test_unwritable_folder(tmp_path, monkeypatch):
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o500)
    # root writes through permissions: make the probe fail as it would for a user
    if os.geteuid() == 0:
        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied")
        monkeypatch.setattr(outputs.tempfile, "TemporaryFile", refuse)
    assert "is not writable: Permission denied" in error(outputs.writable_dir, folder, "out_dir")


@pytest.mark.parametrize("pos", ["learned", "xpos", "alibi"])
@pytest.mark.parametrize("bias", [True, False])
def test_train_flops_per_token_counts_the_models_parameters(pos, bias):
    from model import GPT, GPTConfig

    config = GPTConfig(block_size=32, vocab_size=50, n_layer=3, n_head=4, n_embd=24, bias=bias,
                       pos=pos)
    model = GPT(config)
    n_params = sum(p.numel() for p in model.parameters())  # the tied embedding once
    if pos == "learned":  # a lookup, not a matmul
        n_params -= model.transformer.wpe.weight.numel()
    assert mfu.train_flops_per_token(config) == 6 * n_params + 12 * 3 * 4 * 6 * 32


@pytest.mark.parametrize("name,dtype,tf32,peak", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", True, 989e12),
    ("NVIDIA H100 80GB HBM3", "float32", True, 494e12),  # TF32 tensor cores
    ("NVIDIA H100 80GB HBM3", "float32", False, 67e12),
    ("NVIDIA H100 PCIe", "float16", True, 756e12),
    ("NVIDIA H200", "bfloat16", True, 989e12),
    ("NVIDIA A100-SXM4-80GB", "float32", True, 156e12),
    ("Tesla V100-SXM2-16GB", "float16", True, 125e12),
    # no bfloat16 units: counted at float32's peak
    ("Tesla V100-SXM2-16GB", "bfloat16", True, 15.7e12),
    ("NVIDIA GeForce GTX 1080", "float32", True, None),  # not in the table: MFU is not reported
])
def test_gpu_peak_flops(monkeypatch, name, dtype, tf32, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    before = torch.backends.cuda.matmul.allow_tf32  # a settings object monkeypatch cannot undo
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        assert mfu.peak_flops("cuda:0", dtype) == peak
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_cpu_peak_flops_is_measured_once_and_never_an_mfu_peak():
    """bench.py measures a CPU's matmul speed once per process; train.py gets no CPU peak (MFU
    not reported there)."""
    mfu.cpu_matmul_flops.cache_clear()
    peak = mfu.cpu_matmul_flops("float32")
    assert 1e8 < peak < 1e14 and mfu.cpu_matmul_flops("float32") == peak
    assert mfu.cpu_matmul_flops.cache_info().hits == 1
    assert mfu.peak_flops("cpu", "float32") is None and mfu.peak_flops("mps", "float32") is None


def damage_record(path, record="data/0", at=5):
    """Flip one bit inside a zip record of a torch checkpoint, leaving the zip readable
    (torch.load skips the CRCs)."""
    import struct
    import zipfile
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/" + record))
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH",
                                        raw[info.header_offset + 26: info.header_offset + 30])
    raw[info.header_offset + 30 + name_len + extra_len + at] ^= 0x40
    path.write_bytes(bytes(raw))


def test_a_damaged_tensor_record_is_refused_and_an_old_checkpoint_still_loads(tmp_path):
    data = dataset(tmp_path / "a")
    make_checkpoint(tmp_path / "m.pt", data)
    old = {k: v for k, v in torch.load(tmp_path / "m.pt", weights_only=True).items()
           if k != "checksums"}
    torch.save(old, tmp_path / "old.pt")  # as written before checksums were recorded
    checkpoint.load_model(tmp_path / "old.pt")
    checkpoint.load_model(tmp_path / "m.pt")
    damage_record(tmp_path / "m.pt")
    assert ("is damaged: the checksum of its model tensors does not match"
            in error(checkpoint.load_model, tmp_path / "m.pt"))


def test_checkpoint_iter_num_must_be_an_integer(tmp_path):
    data = dataset(tmp_path / "a")
    make_checkpoint(tmp_path / "m.pt", data)
    torch.save(dict(torch.load(tmp_path / "m.pt", weights_only=True), iter_num="20"),
               tmp_path / "s.pt")
    assert ("its iter_num '20' is not an integer >= 0"
            in error(checkpoint.load_checkpoint, tmp_path / "s.pt"))


@pytest.mark.parametrize("refusal, said", [
    (OSError(28, "No space left on device"), ("could not write checkpoint",
                                              "No space left on device")),
    # torch's zip writer turns a refused write (ENOSPC, EFBIG) into a RuntimeError, not an OSError
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
     ("the write stopped short (a full disk",)),
])
def test_a_failed_checkpoint_write_is_one_line_and_keeps_the_previous(tmp_path, monkeypatch,
                                                                      refusal, said):
    path = tmp_path / "ckpt.pt"
    checkpoint.save_checkpoint({"model": {"w": torch.ones(3)}}, path)
    before = path.read_bytes()

    def refused(obj, f):
        open(f, "wb").write(b"half")
        raise refusal
    monkeypatch.setattr(checkpoint.torch, "save", refused)
    message = error(checkpoint.save_checkpoint, {"model": {"w": torch.zeros(3)}}, path)
    assert all(part in message for part in said)
    assert path.read_bytes() == before and not (tmp_path / "ckpt.pt.tmp").exists()


def test_checkpoint_path_is_checked_before_any_work(tmp_path):
    assert checkpoint.checkpoint_path(tmp_path / "run") == tmp_path / "run" / "ckpt.pt"
    (tmp_path / "d" / "ckpt.pt").mkdir(parents=True)
    assert "ckpt.pt is a directory" in error(checkpoint.checkpoint_path, tmp_path / "d")
    assert "File name too long" in error(checkpoint.checkpoint_path, tmp_path / ("x" * 300))


def test_outputs_replace_only_earlier_outputs_of_their_kind(tmp_path):
    data = dataset(tmp_path / "a")
    make_checkpoint(tmp_path / "ckpt.pt", data)
    before = (tmp_path / "ckpt.pt").read_bytes()
    assert ("exists and is not an earlier JSON output"
            in error(outputs.output_path, tmp_path / "ckpt.pt", "--json"))
    assert (tmp_path / "ckpt.pt").read_bytes() == before
    (tmp_path / "theirs.json").write_text('{"rows": []}')  # JSON, but not ours
    assert "is not an earlier JSON output" in error(outputs.output_path, tmp_path / "theirs.json",
                                                    "--json")
    outputs.write_json(tmp_path / "ours.json", {"rows": []}, quiet=True)
    assert outputs.output_path(tmp_path / "ours.json", "--json") == tmp_path / "ours.json"
    plt = outputs.pyplot()
    outputs.save_plot(plt.figure(), tmp_path / "ours.png")  # marked as ours
    assert outputs.output_path(tmp_path / "ours.png", "--plot", plot=True) == tmp_path / "ours.png"
    (tmp_path / "notes.png").write_text("my notes")
    assert "is not an earlier plot" in error(outputs.output_path, tmp_path / "notes.png",
                                             "--plot", plot=True)
    os.symlink(tmp_path / "ours.json", tmp_path / "link.json")
    assert "is not an earlier JSON output" in error(outputs.output_path, tmp_path / "link.json",
                                                    "--json")


@pytest.mark.parametrize("seed", [-1, 10**23, 2**63])
def test_seeds_outside_what_torch_and_numpy_take_are_refused(seed):
    assert (f"--seed {seed} is not allowed: must be an integer from 0 to 2**63 - 1"
            in error(cli.check_seed, seed))

def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_vars(monkeypatch, rank, world=2, port=None, **more):
    for k, v in dict(RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=port or free_port(), **more).items():
        monkeypatch.setenv(k, str(v))


def test_rank_without_the_other_torchrun_variables_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("RANK", "0")  # `RANK=0 python train.py`: torch's ValueError before
    for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert ("RANK='0' is set but not WORLD_SIZE, MASTER_ADDR, MASTER_PORT"
            in error(distributed.setup_distributed, "cpu"))
    torchrun_vars(monkeypatch, "x")
    assert "RANK='x'" in error(distributed.setup_distributed, "cpu")
    torchrun_vars(monkeypatch, 2, world=2)
    assert "0 <= RANK < WORLD_SIZE" in error(distributed.setup_distributed, "cpu")


@pytest.mark.slow
def test_rendezvous_timeout_names_the_missing_ranks(monkeypatch):
    """RANK=0 WORLD_SIZE=2 without a rank 1 waited torch's 30 minutes; now rendezvous_minutes,
    then who is missing."""
    torchrun_vars(monkeypatch, 0)
    message = error(distributed.setup_distributed, "cpu", rendezvous_minutes=0.01)
    assert ("rank(s) 1 of WORLD_SIZE=2 did not join" in message
            and "ddp_rendezvous_minutes" in message)
    torchrun_vars(monkeypatch, 1)  # and a rank 1 with nobody at MASTER_ADDR:MASTER_PORT
    assert ("nothing answers at MASTER_ADDR:MASTER_PORT=127.0.0.1:"
            in error(distributed.setup_distributed, "cpu", rendezvous_minutes=0.01))


def test_one_rank_prints_the_error(monkeypatch):
    """Under torchrun every rank checks the same inputs: rank 0 prints the error, the others exit 1
    quietly, unless the error is one rank's alone (rank_error)."""
    torchrun_vars(monkeypatch, 1)
    monkeypatch.setattr(cli, "QUIET_EXIT_SECONDS", 0)
    with pytest.raises(SystemExit) as e:
        cli.error_exit("x.py", cli.UserError("bad"))
    assert e.value.code == 1
    with pytest.raises(SystemExit) as e:
        cli.error_exit("x.py", cli.rank_error("mine"))
    assert e.value.code == "x.py: error: mine"
    torchrun_vars(monkeypatch, 0)
    with pytest.raises(SystemExit) as e:
        cli.error_exit("x.py", cli.UserError("bad"))
    assert e.value.code == "x.py: error: bad"


@pytest.mark.parametrize("script, argv", [
    ("study.eval_retrieval", ["--ckpt", "x", "--sequences", "abc"]),
    ("sample", ["--ckpt", "x", "--max_new_tokens", "abc"]),
    ("eval_extrapolate", ["--ckpt", "x", "--batch_tokens", "abc"]),
    ("resolution", ["--length", "abc"]),
])
def test_every_evaluation_script_prints_its_error_from_rank_0_alone(script, argv, monkeypatch,
                                                                    capsys):
    """The evaluation scripts exit through error_exit, one line from rank 0 under torchrun and
    none from the others."""
    monkeypatch.setattr(cli, "QUIET_EXIT_SECONDS", 0)
    module = importlib.import_module(script)
    name = script.rpartition(".")[2]
    for rank in (0, 1):
        torchrun_vars(monkeypatch, rank)
        with pytest.raises(SystemExit) as e:
            module.main(argv)
        if rank == 0:
            assert (str(e.value.code).startswith(f"{name}.py: error: argument ")
                    and "abc" in e.value.code)
        else:
            assert e.value.code == 1
        assert capsys.readouterr() == ("", "")


def test_runtime_computes_in_its_dtype():
    """Runtime.ctx is autocast to the resolved dtype (none in float32: auto on CPU); one
    process is rank 0 of 1."""
    from lexgpt.inference_options import Runtime
    a = torch.ones(2, 2)
    for dtype, want in (("auto", torch.float32), ("float32", torch.float32),
                        ("bfloat16", torch.bfloat16)):
        runtime = Runtime.local("cpu", dtype)
        with runtime.ctx:
            assert (a @ a).dtype == want
    assert Runtime.joined("cpu", "auto") == Runtime("cpu", "float32", rank=0, world=1, ddp=False)
    assert Runtime("cpu").all_reduce_sum(a) is a  # no process group: the sum is this process's


def test_a_scaling_asked_for_counts_over_the_checkpoints_original_length():
    """inference_options.checkpoint_scaling: where no scaling is asked for, the checkpoint's own;
    a factor asked for (pi, ntk, yarn) counts over the original length a fine-tune stores, as its
    own does; dynamic NTK, none, a factor from the length and a model never fine-tuned count over
    block_size. rule_fields records the length used; pointless refuses a fixed factor not
    resolved so (a script that skips checkpoint_scaling) and a factor from the length on a
    checkpoint trained with one."""
    from lexgpt.inference_options import checkpoint_scaling, pointless, rule_fields
    from model import AttentionRule, GPTConfig, RopeScaling
    tuned = GPTConfig(block_size=64, vocab_size=11, n_layer=1, n_head=2, n_embd=16, pos="rope",
                      rope_scaling="yarn", rope_factor=2.0, rope_original_length=8)
    plain = GPTConfig(block_size=64, vocab_size=11, n_layer=1, n_head=2, n_embd=16, pos="rope")
    causal = AttentionRule("causal")
    for config, asked, want, length in (
            (tuned, None, RopeScaling("yarn", 2.0, 8), 8),
            (tuned, RopeScaling("yarn", 2.0), RopeScaling("yarn", 2.0, 8), 8),
            (tuned, RopeScaling("ntk", 3.0), RopeScaling("ntk", 3.0, 8), 8),
            (tuned, RopeScaling("pi", 3.0), RopeScaling("pi", 3.0, 8), 8),
            (tuned, RopeScaling("dynamic_ntk"), RopeScaling("dynamic_ntk"), 64),
            (tuned, RopeScaling("none"), RopeScaling(), None),
            (plain, RopeScaling("yarn", 3.0), RopeScaling("yarn", 3.0), 64),
            (plain, RopeScaling("yarn"), RopeScaling("yarn"), 64)):
        scaling = checkpoint_scaling(config, asked)
        assert scaling == want and pointless(config, causal, scaling) is None
        assert rule_fields(causal, scaling, 64, 128)["rope_original_length"] == length
    assert ("yarn s=3 would count over block_size (64), not the original length (8) this "
            "checkpoint stores" in pointless(tuned, causal, RopeScaling("yarn", 3.0)))
    # without a factor, s follows the length from its original length (YaRN's dynamic rule),
    # which is its own s up to block_size only where that is block_size / l
    assert ("yarn without --rope_factor takes s = max(L, block_size) / 8, 8 up to block_size "
            "(64), not the yarn s=2 from 8 this checkpoint was trained with"
            in pointless(tuned, causal, checkpoint_scaling(tuned, RopeScaling("yarn"))))
    whole = GPTConfig(block_size=64, vocab_size=11, n_layer=1, n_head=2, n_embd=16, pos="rope",
                      rope_scaling="yarn", rope_factor=8.0, rope_original_length=8, yarn_alpha=0.5,
                      yarn_beta=8.0)
    dynamic = checkpoint_scaling(whole, RopeScaling("yarn"))
    assert dynamic == RopeScaling("yarn", None, 8, 0.5, 8.0)  # its own ends, unless asked
    assert pointless(whole, causal, dynamic) is None
    assert [dynamic.factor_at(n, 64) for n in (32, 64, 128)] == [8.0, 8.0, 16.0]
    fields = rule_fields(causal, dynamic, 64, 128)
    assert (fields["rope_factor"], fields["rope_original_length"]) == (None, 8)
    assert (fields["yarn_alpha"], fields["yarn_beta"]) == (0.5, 8.0)
    asked = checkpoint_scaling(whole, RopeScaling("yarn", 8.0, alpha=2.0))
    assert (asked.alpha, asked.beta) == (2.0, 8.0)
    # one end asked for beyond the checkpoint's other: one line, not a traceback
    with pytest.raises(cli.UserError, match=r"^yarn_alpha=16.0, yarn_beta=8.0 are not allowed: .*; "
                       "the checkpoint's own are yarn_alpha=0.5, yarn_beta=8$"):
        checkpoint_scaling(whole, RopeScaling("yarn", 8.0, alpha=16.0))


def test_a_run_directory_has_one_owner(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    run_dir.own_run_dir(out)
    try:
        assert f"pid {os.getpid()} on host" in run_dir.run_dir_owner(out)
        # a second open of the lock conflicts, even in one process
        message = error(run_dir.own_run_dir, out)
        assert f"out_dir {out} is in use by pid {os.getpid()} on host" in message
    finally:
        run_dir.release_run_dirs()
    assert run_dir.run_dir_owner(out) is None and not (out / "lock").exists()
    # a dead owner's: no flock holds it
    (out / "lock").write_text("pid 99999999 on host gone (train.py)\n")
    assert run_dir.run_dir_owner(out) is None
    run_dir.own_run_dir(out)
    assert f"pid {os.getpid()}" in (out / "lock").read_text()
    run_dir.release_run_dirs()


def test_a_failed_start_removes_its_empty_log_before_it_lets_go(tmp_path, monkeypatch):
    """A failed start's empty log.jsonl is removed while out_dir is still this process's: once the
    lock is let go, another trainer may take out_dir, and its new log is empty too."""
    run_dir.own_run_dir(tmp_path)
    (tmp_path / "log.jsonl").touch()
    release, seen = run_dir.release_run_dirs, []
    monkeypatch.setattr(run_dir, "release_run_dirs",
                        lambda: seen.append((tmp_path / "log.jsonl").exists()) or release())
    run_dir.remove_debris(tmp_path, made=True)
    # the lock's file gone, then the folder
    assert seen == [False] and not run_dir.OWNED and not tmp_path.exists()


def test_a_run_directory_without_locks_is_owned_with_a_note(tmp_path, monkeypatch, capsys):
    """A filesystem without flock (some NFS mounts): a note, and the directory counts as this
    process's, so that a failed start still removes its empty log (remove_debris)."""
    import errno

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(run_dir.fcntl, "flock", no_locks)
    run_dir.own_run_dir(tmp_path)
    assert capsys.readouterr().out == (f"note: out_dir {tmp_path} cannot be locked "
                                       f"({os.strerror(errno.ENOLCK)}): nothing stops a second "
                                       "trainer there\n")
    assert list(run_dir.OWNED) == [tmp_path / "lock"]
    (tmp_path / "log.jsonl").touch()
    run_dir.remove_debris(tmp_path, made=False)
    assert not run_dir.OWNED and not (tmp_path / "log.jsonl").exists()


@pytest.mark.slow
def test_rendezvous_meets_and_catches_a_disagreement_on_world_size():
    """Two ranks meet in the store (threads here stand for processes); ranks told different
    WORLD_SIZEs would leave rank 0 waiting for a rank that never comes (gloo's connect, 30 minutes):
    a one-line error instead."""
    from concurrent.futures import ThreadPoolExecutor

    def meet(worlds, port=None):
        port = port or free_port()
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(distributed.rendezvous, rank, world, "127.0.0.1", port, 0.1)
                       for rank, world in enumerate(worlds)]
            return [f.exception() or f.result() for f in futures]

    assert all(isinstance(r, distributed.dist.TCPStore) for r in meet((2, 2)))
    rank0, _ = meet((2, 3))
    assert str(rank0) == ("the processes disagree on WORLD_SIZE (rank 0: 2, rank 1: 3): give every "
                          "one the same")


@pytest.mark.parametrize("script, argv", [
    ("study.eval_retrieval", ["--ckpt", "x", "--sequences", "abc"]),
    ("sample", ["--ckpt", "x", "--max_new_tokens", "abc"]),
    ("eval_extrapolate", ["--ckpt", "x", "--batch_tokens", "abc"]),
    ("resolution", ["--length", "abc"]),
    ("study.reproduce", ["--budget", "huge"]),
    ("bench", ["--nope"]),
])
def test_a_bad_flag_is_one_line_with_status_1(script, argv, capsys):
    """argparse's errors as every other error of the scripts: one line naming the flag, not the
    usage and status 2."""
    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as e:
        module.main(argv)
    name = script.rpartition(".")[2]
    assert isinstance(e.value.code, str) and e.value.code.startswith(f"{name}.py: error: ")
    assert ("\n" not in e.value.code
            and ("abc" in e.value.code or "huge" in e.value.code or "--nope" in e.value.code))
    assert "usage:" not in capsys.readouterr().err
