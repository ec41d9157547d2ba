"""
Helpers every script shares (model.py stays model-only): the one-line errors the command lines print instead of
tracebacks, checkpoints, devices and precision, torchrun, output files written atomically, and model FLOPs
utilization (MFU).
"""

import argparse
import ctypes
import datetime
import errno
import fcntl
import functools
import json
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
import zlib
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from model import GPT, GPTConfig


LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # loaded before any fork


def die_with_parent(parent):
    """In a child process: Linux sends it SIGKILL when its parent dies, however the parent dies (prctl's
    PR_SET_PDEATHSIG); if the parent (pid `parent`) died before this call, no signal will come, so it dies now. A
    no-op elsewhere."""
    if LIBC is None:
        return
    LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


class UserError(Exception):
    """A bad input from the user: scripts print it as one line and exit with status 1."""


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(obj, path):
    """torch.save to a temporary file, then rename: a crash mid-write never leaves a truncated checkpoint, and a
    failed write (a full disk) is a one-line error that leaves the previous checkpoint in place. The checkpoint
    carries a CRC-32 of each tensor-holding part (tensor_checksums), which load_checkpoint verifies."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save(dict(obj, checksums=tensor_checksums(obj)), tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"could not write checkpoint {path}: {e.strerror or e}; the previous one, if any, is kept") \
            from None
    except RuntimeError as e:  # how torch's zip writer reports a write the system refused (ENOSPC, EFBIG)
        tmp.unlink(missing_ok=True)
        if "unexpected pos" not in str(e) and "failed writing" not in str(e):
            raise
        raise UserError(f"could not write checkpoint {path}: the write stopped short (a full disk, or a file size "
                        "limit); the previous one, if any, is kept") from None


def tensor_checksums(obj, parts=None):
    """{part: CRC-32} over the bytes, names, dtypes and shapes of every tensor in each top-level part of obj (model,
    optimizer, rng, ...) that holds tensors. torch.load does not check the zip's own CRCs, so a damaged record would
    otherwise load as silently wrong weights; CRC-32 runs at about the speed of reading the bytes from memory."""
    def crc(value, key, acc):
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous().reshape(-1)
            acc = zlib.crc32(f"{key}:{t.dtype}:{tuple(value.shape)}".encode(), acc)
            return zlib.crc32(t.view(torch.uint8).numpy() if t.numel() else b"", acc)
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) \
            else ()
        for k, v in items:
            acc = crc(v, f"{key}.{k}", acc)
        return acc

    has_tensor = lambda v: isinstance(v, torch.Tensor) or isinstance(v, (dict, list, tuple)) and any(
        map(has_tensor, v.values() if isinstance(v, dict) else v))
    return {k: crc(v, k, 0) for k, v in obj.items() if (parts is None or k in parts) and has_tensor(v)}


def keep_checkpoint(path, iter_num, keep, best):
    """Keep the checkpoint just written at path as ckpt_<iter_num>.pt, and as ckpt_best.pt when best, removing all but
    the `keep` latest ckpt_<iter>.pt: hard links where the filesystem has them (no second copy on disk), else copies;
    each put in place by a rename, so that a kill never leaves one half-written."""
    path = Path(path)
    for name in [f"ckpt_{iter_num:07d}.pt"] + (["ckpt_best.pt"] if best else []):
        target, tmp = path.with_name(name), path.with_name(name + ".tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copyfile(path, tmp)
        os.replace(tmp, target)
    for old in sorted(path.parent.glob("ckpt_[0-9]*.pt"))[:-keep]:
        old.unlink()


def checkpoint_path(out_dir):
    """out_dir/ckpt.pt, checked before any work: a path the operating system takes (no name over its limit), and no
    directory in the checkpoint's place (which the first save would fail on, after the first evaluation)."""
    path = Path(out_dir) / "ckpt.pt"
    try:
        if path.is_dir():
            raise UserError(f"{path} is a directory, not a checkpoint: remove it or give another out_dir")
    except OSError as e:
        raise UserError(f"out_dir {out_dir} is not usable: {e.strerror}") from None
    return path


# Format 2 (this version) records the tokenizer's identity, and goes with pos="sinusoidal" models whose token
# embeddings are scaled by sqrt(n_embd): an older sinusoidal checkpoint would be scored with the wrong input scale.
CHECKPOINT_FORMAT = 2


def load_checkpoint(path, map_location="cpu", mmap=False, verify=("model",)):
    """A lex-gpt checkpoint, checked. mmap=True reads lazily: cheap for checks that do not need the weights. verify:
    the parts whose checksum is checked (True: every part that has one), the model's by default: a checksum reads
    its part in full. A checkpoint from before checksums were recorded loads unchecked."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:
        raise UserError(f"checkpoint {path} is unreadable (truncated or corrupt?): {type(e).__name__}") from e
    missing = [k for k in ("model", "model_args", "config") if k not in ckpt] if isinstance(ckpt, dict) else ["model"]
    if missing:
        raise UserError(f"checkpoint {path} is not a lex-gpt checkpoint (no {'/'.join(missing)})")
    if not isinstance(ckpt["config"], dict) or "data_dir" not in ckpt["config"] or not isinstance(
            ckpt["model_args"], dict):
        raise UserError(f"checkpoint {path} is not a lex-gpt checkpoint (no config.data_dir, or model_args not a dict)")
    iter_num = ckpt.get("iter_num", 0)
    if not isinstance(iter_num, int) or isinstance(iter_num, bool) or iter_num < 0:
        raise UserError(f"checkpoint {path} is damaged: its iter_num {iter_num!r} is not an integer >= 0")
    if ckpt["model_args"].get("pos") == "sinusoidal" and ckpt.get("format", 1) < CHECKPOINT_FORMAT:
        raise UserError(f"checkpoint {path} is a sinusoidal model from before token embeddings were scaled by "
                        "sqrt(n_embd): retrain it with this version")
    verify_checksums(ckpt, path, verify)
    return ckpt


def verify_checksums(ckpt, path, parts):
    recorded = ckpt.get("checksums", {})
    if not isinstance(recorded, dict):
        raise UserError(f"checkpoint {path} is damaged: its checksums field is a {type(recorded).__name__}")
    parts = [k for k in recorded if parts is True or k in parts]
    if not parts:
        return
    try:
        found = tensor_checksums(ckpt, parts)
    except Exception as e:  # a damaged record can fail to read at all
        raise UserError(f"checkpoint {path} is damaged: reading its tensors failed ({type(e).__name__})") from None
    bad = [k for k in parts if found.get(k) != recorded[k]]
    if bad:
        raise UserError(f"checkpoint {path} is damaged: the checksum of its {', '.join(bad)} tensors does not match "
                        "the one recorded when it was written (one edited on purpose: save it with save_checkpoint)")


def model_config(ckpt, path):
    """The checkpoint's GPTConfig, or a one-line error when its model_args are not a valid one."""
    try:
        return GPTConfig(**ckpt["model_args"])
    except (TypeError, ValueError) as e:
        raise UserError(f"checkpoint {path} has unusable model_args: {e}") from None


def load_weights(model, state_dict, path):
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as e:
        detail = "; ".join(line.strip() for line in str(e).splitlines()[1:3])
        raise UserError(f"checkpoint {path}: the weights do not fit its model_args ({detail[:300]})") from None


def load_model(path, device="cpu"):
    """The checkpoint's model, uncompiled, in eval mode on device, and the checkpoint's other fields. The file is read
    through a memory map and only the weights reach the device: AdamW's state, twice the weights, stays on disk."""
    ckpt = load_checkpoint(path, mmap=True)
    model = GPT(model_config(ckpt, path))
    load_weights(model, ckpt["model"], path)
    return model.to(device).eval(), {k: v for k, v in ckpt.items() if k not in ("model", "optimizer", "scaler", "rng")}


# ---------------------------------------------------------------------------------------------------------------
# Devices, precision, torchrun
DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_device(device):
    """auto -> cuda when available, else cpu; any other value is checked: cpu, cuda, cuda:N, mps."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"device={device!r} is not allowed: must be auto, cpu, cuda, cuda:N or mps")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device={device!r} but this PyTorch sees no CUDA device")
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise UserError(f"device={device!r} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device={device!r} but MPS is not available here")
    return device


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_env():
    """None without torchrun (no RANK); else (rank, world, local_rank, master_addr, master_port), checked: RANK set
    alone (`RANK=0 python train.py`) or a malformed variable is a one-line error, not torch's ValueError. LOCAL_RANK
    (0 if unset) only picks the GPU: setup_distributed asks for it on CUDA."""
    if "RANK" not in os.environ:
        return None
    missing = [v for v in TORCHRUN_VARS if not os.environ.get(v) and v != "LOCAL_RANK"]  # that one: CUDA's alone
    if missing:
        raise UserError(f"RANK={os.environ['RANK']!r} is set but not {', '.join(missing)}: launch with torchrun, "
                        "which sets them all, or unset RANK for a single process")
    values = {v: os.environ.get(v, "0") for v in TORCHRUN_VARS}
    try:
        rank, world, local, port = (int(values[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"))
    except ValueError:
        rank = world = local = port = -1
    if not (0 <= rank < world and local >= 0 and 0 < port < 65536):
        raise UserError("the torchrun variables " + ", ".join(f"{k}={v!r}" for k, v in values.items()) + " do not fit:"
                        " integers with 0 <= RANK < WORLD_SIZE, LOCAL_RANK >= 0 and 0 < MASTER_PORT < 65536")
    return rank, world, local, values["MASTER_ADDR"], port


def rendezvous(rank, world, addr, port, minutes):
    """The TCPStore at MASTER_ADDR:MASTER_PORT, once all WORLD_SIZE processes have checked in there; after `minutes`
    without them a one-line error naming the ranks missing (torch alone waits its collective timeout, 30 minutes).
    Under torchrun its agent hosts the store; otherwise rank 0 does, as torch's env:// rendezvous."""
    deadline = time.monotonic() + 60 * minutes
    host = not rank and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    where = f"MASTER_ADDR:MASTER_PORT={addr}:{port}"
    while not host:  # a plain socket first: TCPStore's own retries print C++ stack traces while they wait
        try:
            socket.create_connection((addr, port), timeout=5).close()
            break
        except socket.gaierror as e:
            raise rank_error(f"MASTER_ADDR={addr!r}: {e.strerror}") from None
        except OSError:
            if time.monotonic() > deadline:
                raise rank_error(f"rank {rank}: nothing answers at {where} after {minutes:g} minutes: is rank 0 "
                                 "running, and is that address reachable from here? (ddp_rendezvous_minutes)") from None
            time.sleep(0.2)
    try:
        store = dist.TCPStore(addr, port, world, is_master=host, wait_for_workers=False, multi_tenant=True,
                              timeout=datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())))
    except dist.DistError as e:
        raise rank_error(f"rank {rank}: no rendezvous at {where}: {str(e).splitlines()[0]}") from None
    keys = [f"lex-gpt/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/joined/{r}" for r in range(world)]
    store.set(keys[rank], f"{world} {socket.gethostname()}")
    while True:  # polled: store.wait's timeout logs C++ warnings
        try:
            joined = [store.check([key]) for key in keys]
        except dist.DistError:  # rank 0's store went away: its own error says why
            raise rank_error(f"rank {rank}: the rendezvous at {where} closed (rank 0 stopped)") from None
        if all(joined):
            break
        if time.monotonic() > deadline:
            missing = ", ".join(str(r) for r in range(world) if not joined[r])
            raise rank_error(f"rank {rank}: rank(s) {missing} of WORLD_SIZE={world} did not join at {where} within "
                             f"{minutes:g} minutes (ddp_rendezvous_minutes): start them, or fix WORLD_SIZE",
                             quiet=rank != joined.index(True))  # said once, by the lowest rank that came
        time.sleep(0.1)
    worlds = [int(store.get(key).split()[0]) for key in keys]
    if worlds != [world] * world:
        said = ", ".join(f"rank {r}: {w}" for r, w in enumerate(worlds))
        raise UserError(f"the processes disagree on WORLD_SIZE ({said}): give every one the same")
    return store


def setup_distributed(device, timeout_minutes=None, rendezvous_minutes=10.0):
    """(ddp, rank, world, device): under torchrun (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) join the
    process group, NCCL on CUDA (one GPU per local rank) and gloo on CPU; otherwise a single process. The ranks meet
    within rendezvous_minutes (rendezvous) or stop with a one-line error naming the missing ones. timeout_minutes
    bounds every collective after that (torch's default otherwise): the ranks wait in one while rank 0 writes a
    checkpoint, which on a slow shared filesystem can take minutes."""
    env = torchrun_env()
    device = resolve_device(device)
    if env is None:
        return False, 0, 1, device
    rank, world, local, addr, port = env
    if device.startswith("cuda") and "LOCAL_RANK" not in os.environ:
        raise UserError("LOCAL_RANK is not set: on CUDA it picks each process's GPU; launch with torchrun")
    if device == "cuda":
        device = f"cuda:{local}"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    store = rendezvous(rank, world, addr, port, rendezvous_minutes)
    timeout = {"timeout": datetime.timedelta(minutes=timeout_minutes)} if timeout_minutes else {}
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo", store=store, rank=rank,
                            world_size=world, **timeout)
    return True, rank, world, device


def agree_on_error(problem, ddp, device):
    """Under torchrun, after checks that may fail on some ranks only (rank 0's out_dir, a file one node cannot see):
    every rank learns whether any failed and all stop together, instead of the others waiting in their next
    collective; the lowest failing rank prints its error, the others exit quietly. Alone: raise problem, if any."""
    if not ddp:
        if problem:
            raise problem
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    first = torch.tensor(float(rank if problem else world), device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    if first.item() < world:
        teardown_distributed(ddp)
        raise rank_error(problem or "another rank failed", quiet=rank != int(first.item()))


QUIET_EXIT_SECONDS = 3


def rank_error(message, quiet=False):
    """A UserError that error_exit prints (quiet=False) or not whatever this process's rank: for an error that one
    rank alone knows of."""
    error = UserError(str(message))
    error.quiet = quiet
    return error


class ArgumentParser(argparse.ArgumentParser):
    """argparse's errors as the project's: one line and status 1 (each script's main prints it), not the usage and
    status 2."""

    def error(self, message):
        raise UserError(message)


def error_exit(script, error):
    """Exit with status 1 and the one-line error, printed by one process under torchrun: rank 0, since the ranks
    check the same inputs and would print it once each, while the others exit quietly. An error that one rank alone
    may know of (agree_on_error, the rendezvous) says itself whether to print (rank_error)."""
    quiet = getattr(error, "quiet", None)
    if quiet is None:
        quiet = launch_rank() > 0
    if quiet:  # torchrun stops every rank once one has exited: give rank 0 the time to print
        time.sleep(QUIET_EXIT_SECONDS)
    sys.exit(1 if quiet else f"{script}: error: {error}")


def launch_rank():
    """torchrun's RANK for this process, 0 without torchrun or where its variables do not fit (then each process
    prints torchrun_env's error itself)."""
    try:
        env = torchrun_env()
    except UserError:
        return 0
    return env[0] if env else 0


def exit_interrupted(script, kept):
    """Ctrl-C (KeyboardInterrupt): one line saying what was kept (kept(), from rank 0 alone under torchrun) and exit
    status 130, as a shell reports it. In a process group, os._exit: tearing gloo down with a collective cut short
    aborts the process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while kept() looks is no traceback either
    if launch_rank() == 0:
        print(f"{script}: interrupted (Ctrl-C): {kept()}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        sys.stdout.flush()
        os._exit(130)
    sys.exit(130)


def resolve_dtype(dtype, device):
    """The one default-precision rule, for every script: bfloat16 autocast on GPUs of compute capability >= 8.0,
    float16 (with a GradScaler when training) on older ones (V100 reports is_bf16_supported() through slow
    emulation), float32 on CPU and MPS. Evaluation's output layer and loss stay float32 under any of them."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.get_device_capability(device)[0] >= 8 else "float16"
    return "float32"


def autocast(device, dtype):
    return nullcontext() if dtype == "float32" else torch.autocast(device.split(":")[0], getattr(torch, dtype))


def all_reduce_sum(t, ddp):
    if ddp:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)  # gloo has no AVG
    return t


_HELD_UNTIL_EXIT = []  # see teardown_distributed


def catch_stop_signals():
    """SIGTERM (a scheduler preempting the job; torchrun passes it on to every rank) and SIGUSR1 (e.g. SLURM's
    --signal=USR1@120 warning) ask train.py for a checkpoint and a clean stop at its next log step, where the ranks
    agree on it. Returns the list into which the names of the signals caught go."""
    caught = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: caught.append(signal.Signals(signum).name))
    return caught


def teardown_distributed(ddp):
    """Leave the process group: a barrier whose handle this process keeps until it exits, then
    destroy_process_group.

    Why: gloo finishes each collective on a worker thread, and if that thread drops the last reference to the work
    while the interpreter shuts down, the process aborts ("terminate called without an active exception"). The
    barrier waits, with the GIL released, until every rank has finished, and its work holds every collective still
    in flight; keeping its handle to the end makes this thread, not a worker, the last to release them. A plain
    barrier is not enough. docs/engineering_notes.md has the whole story.
    """
    if ddp:
        barrier = dist.barrier(async_op=True)
        barrier.wait()
        _HELD_UNTIL_EXIT.append(barrier)
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# A run directory has one owner: an advisory lock on out_dir/lock (flock), which the kernel drops when its process dies


LOCK_NAME = "lock"
_owned = {}  # lock file -> descriptor, held by this process until release_run_dirs


def own_run_dir(folder, what="out_dir"):
    """Take out_dir for this process, or a one-line error naming its owner (pid and host, written in the lock file):
    two trainers in one directory would rename each other's checkpoints away. A lock left by a dead process is free
    (flock locks die with their process), so it is taken over. Where the filesystem has no locks, a note and no lock."""
    path = Path(folder) / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = lock_owner(fd)
            os.close(fd)
            raise UserError(f"{what} {folder} is in use by {owner}: one process at a time writes a run; wait for it "
                            "to end or stop it, or give another out_dir") from None
        except OSError as e:
            os.close(fd)
            print(f"note: {what} {folder} cannot be locked ({e.strerror}): nothing stops a second trainer there")
            return
        try:  # the owner before us removes the file as it lets go: ours must still be the one at path
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    line = f"pid {os.getpid()} on host {socket.gethostname()} ({Path(sys.argv[0]).name})\n".encode()
    os.pwrite(fd, line.ljust(os.fstat(fd).st_size), 0)  # in one write: a reader sees a whole line, old or new
    os.ftruncate(fd, len(line))
    _owned[path] = fd


def lock_owner(fd):
    """The owner's line in a lock file. A new owner writes it just after it locks: an empty file gets a moment."""
    for _ in range(100):
        owner = os.pread(fd, 200, 0).decode(errors="replace").strip()
        if owner:
            return owner
        time.sleep(0.01)
    return "another process"


def release_run_dirs():
    """Let go of every run directory this process owns (removing the lock file first, so that none is left behind)."""
    while _owned:
        path, fd = _owned.popitem()
        path.unlink(missing_ok=True)
        os.close(fd)


def run_dir_owner(folder):
    """Who holds folder's lock ("pid N on host H (script)"), or None when no live process does."""
    try:
        fd = os.open(Path(folder) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return lock_owner(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------------
# Output files, written so that a kill never leaves one that reads as finished


# Every JSON output carries this field, so that --json replaces a file only when it is an earlier output of ours
OUTPUT_MARK = {"written_by": "lex-gpt"}


def write_json(path, obj, quiet=False):
    """Write obj (a dict: OUTPUT_MARK is added) as JSON in one atomic rename, so that a kill never leaves a partial
    file that reads as finished."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({**OUTPUT_MARK, **obj} if isinstance(obj, dict) else obj, indent=1) + "\n")
    partial.replace(path)
    if not quiet:
        print(f"wrote {path}")


def pyplot():
    """matplotlib's pyplot without a display, or a one-line error when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    return plt


# The first bytes of each image format matplotlib writes that --plot may replace; a file of any other format is kept
IMAGE_SIGNATURES = {"png": (b"\x89PNG\r\n\x1a\n",), "pdf": (b"%PDF-",), "svg": (b"<?xml", b"<svg"),
                    "svgz": (b"\x1f\x8b",), "eps": (b"%!PS",), "ps": (b"%!PS",), "jpg": (b"\xff\xd8\xff",),
                    "jpeg": (b"\xff\xd8\xff",), "tif": (b"II*\x00", b"MM\x00*"), "tiff": (b"II*\x00", b"MM\x00*"),
                    "webp": (b"RIFF",)}


def output_path(path, flag, plot=False):
    """Where --flag writes, checked before any work starts: not a directory, and its folder can be created and
    written. A plot path without a suffix gets .png (matplotlib would add it silently); its format must be one
    matplotlib can write. An existing file is replaced only when it is an earlier output of the same kind
    (earlier_output): --json out/ckpt.pt must not turn a checkpoint into JSON."""
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
            raise UserError(f"{flag} {path}: matplotlib cannot write {path.suffix} files; use .png, .pdf or .svg")
    if (path.exists() or path.is_symlink()) and not earlier_output(path, plot):
        raise UserError(f"{flag} {path} exists and is not an earlier {'plot' if plot else 'JSON output'} of "
                        "lex-gpt: refusing to replace it; give a new file name, or remove it first")
    writable_dir(path.parent, flag)
    return path


def earlier_output(path, plot):
    """Whether the file at path is one this project wrote: JSON carrying OUTPUT_MARK, or an image whose first bytes
    are its format's signature (IMAGE_SIGNATURES). Anything else, a symlink included, is not."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        if plot:
            signatures = IMAGE_SIGNATURES.get(path.suffix[1:].lower())
            with open(path, "rb") as f:
                head = f.read(1024)
            return bool(signatures) and head.startswith(signatures) and (b"<svg" in head or path.suffix != ".svg")
        if path.stat().st_size > 1 << 30:  # no output of ours is this large
            return False
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # unreadable, not UTF-8 or not JSON
        return False
    return isinstance(obj, dict) and all(obj.get(k) == v for k, v in OUTPUT_MARK.items())


def check_seed(seed, flag="--seed"):
    """A seed both torch.manual_seed and numpy's SeedSequence take, or a one-line error (numpy refuses negative
    seeds, torch those of 2^64 and over; 2^63 leaves room for the seed + rank of each process)."""
    if not (isinstance(seed, int) and 0 <= seed < 2**63):
        raise UserError(f"{flag} {seed} is not allowed: must be an integer from 0 to 2**63 - 1")
    return seed


def open_log(path, start_iter):
    """A JSON-lines log opened for appending, kept only up to start_iter: the entries from start_iter on (which a
    resumed run writes again) and any line a kill cut short are dropped, so that after any number of kills and resumes
    the log equals the uninterrupted run's; start_iter 0 starts it afresh. Rewritten by a rename, never half-written."""
    path, kept = Path(path), []
    if start_iter and path.is_file():
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            if isinstance(entry, dict) and entry.get("iter", start_iter) < start_iter:
                kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
    return open(path, "a")


def writable_dir(folder, what):
    """Create folder if needed and prove it writable with a scratch file, or a one-line error naming it."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except (FileExistsError, NotADirectoryError):
        try:
            os.stat(folder)  # mkdir's "exists" also stands for a loop of symbolic links: name the real problem
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UserError(f"{what} {folder}: {e.strerror}") from None
        raise UserError(f"{what} {folder}: it (or a folder above it) is a file, not a directory") from None
    except OSError as e:
        raise UserError(f"{what} {folder} is not writable: {e.strerror}") from None
    return folder


# ---------------------------------------------------------------------------------------------------------------
# Model FLOPs utilization (MFU)


def train_flops_per_token(config):
    """Training FLOPs per token of a GPT of this config (n_layer, n_head, n_embd, block_size, vocab_size, pos, bias),
    by PaLM's appendix B as nanoGPT's estimate_mfu counts them: 6N for the parameters' matmuls forward and backward,
    plus 12 L H Q T for attention's scores and weighted sums over T = block_size keys.

    N is counted from the config, as model.GPT lays it out: the token embedding once (it is tied to the output
    layer, whose matmul it is), per block 12 n_embd^2 weights, 2 LayerNorm scales and 11 n_embd biases when
    bias=True, and the final LayerNorm. A learned position table is a lookup, not a matmul: not counted, as in
    nanoGPT."""
    L, C, T, V = config.n_layer, config.n_embd, config.block_size, config.vocab_size
    bias = int(config.bias)
    n_params = V * C + L * (12 * C * C + (2 + 11 * bias) * C) + (1 + bias) * C
    return 6 * n_params + 12 * L * config.n_head * (C // config.n_head) * T


# Peak dense matmul FLOP/s per GPU by dtype, first name match wins (torch.cuda.get_device_name, e.g. "NVIDIA H100
# 80GB HBM3"). float32 has two entries: TF32 tensor cores, which float32 matmuls use when
# torch.backends.cuda.matmul.allow_tf32 is on (train.py turns it on), and plain float32. V100 has neither bfloat16
# nor TF32: bfloat16 is counted at its float32 peak. Vendor figures, dense (no 2:4 sparsity), SXM boards: a PCIe
# H100 peaks lower and has its own entry; a PCIe V100 or A100 is counted at its SXM figures (a few % off for V100).
GPU_PEAK_FLOPS = (  # name substring, {bfloat16, float16, tf32, float32}
    ("H100 PCIe", dict(bfloat16=756e12, float16=756e12, tf32=378e12, float32=51e12)),
    ("H100", dict(bfloat16=989e12, float16=989e12, tf32=494e12, float32=67e12)),
    ("H200", dict(bfloat16=989e12, float16=989e12, tf32=494e12, float32=67e12)),  # H100 SXM's compute, more memory
    ("A100", dict(bfloat16=312e12, float16=312e12, tf32=156e12, float32=19.5e12)),
    ("V100", dict(bfloat16=15.7e12, float16=125e12, tf32=15.7e12, float32=15.7e12)),
)


def peak_flops(device, dtype):
    """Peak matmul FLOP/s of one device in dtype ("float32", "bfloat16", "float16"), the denominator of MFU: the
    table above for GPUs; None where no trustworthy peak is known (a GPU not in it, MPS, and a CPU, whose cores other
    work may share: a peak measured then reads low and MFU impossibly high), and MFU is then not reported."""
    if device.split(":")[0] != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peaks = next((p for key, p in GPU_PEAK_FLOPS if key in name), None)
    if peaks is None:
        return None
    if dtype == "float32" and torch.backends.cuda.matmul.allow_tf32:
        dtype = "tf32"
    return peaks[dtype]


@functools.cache
def cpu_matmul_flops(dtype):
    """This CPU's matmul FLOP/s in dtype, measured once per process (a CPU has no vendor peak to divide by): the
    median of 3 timed n x n F.linear calls (the op nn.Linear runs), n doubled from 256 until one takes 10 ms, so
    that every core is busy, or n reaches 2048. A machine busy with other work measures low, and MFU then reads
    high."""
    n = 256
    while True:
        a, b = (torch.randn(n, n).to(getattr(torch, dtype)) for _ in range(2))
        F.linear(a, b)  # warm-up: the first call sets up the kernel
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            F.linear(a, b)
            times.append(time.perf_counter() - t0)
        if statistics.median(times) > 0.01 or n >= 2048:
            return 2 * n**3 / statistics.median(times)
        n *= 2
