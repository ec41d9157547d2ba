"""
Devices, precision and torchrun, for every script that runs a model: the device and dtype rules,
autocast, joining the process group (with a rendezvous that names the ranks missing), the sums
the ranks share, and leaving the group without gloo's crash at exit.
"""

import datetime
import os
import socket
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from lexgpt.cli import UserError, rank_error, torchrun_env

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
    count = torch.cuda.device_count()
    if parsed.type == "cuda" and (parsed.index or 0) >= count:
        raise UserError(f"device={device!r} but this machine has {count} CUDA device(s)")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device={device!r} but MPS is not available here")
    return device


def resolve_dtype(dtype, device):
    """The one default-precision rule, for every script: bfloat16 autocast on GPUs of compute
    capability >= 8.0, float16 (with a GradScaler when training) on older ones (V100 reports
    is_bf16_supported() through slow emulation), float32 on CPU and MPS. Evaluation's output layer
    and loss stay float32 under any of them."""
    if dtype != "auto":
        return dtype
    if not device.startswith("cuda"):
        return "float32"
    if torch.cuda.get_device_capability(device)[0] >= 8:
        return "bfloat16"
    return "float16"


def autocast(device, dtype):
    if dtype == "float32":
        return nullcontext()
    return torch.autocast(device.split(":")[0], getattr(torch, dtype))


def setup_distributed(device, timeout_minutes=None, rendezvous_minutes=10.0):
    """(ddp, rank, world, device): under torchrun (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) join the process group, NCCL on CUDA (one GPU per local rank) and gloo on CPU;
    otherwise a single process. The ranks meet within rendezvous_minutes (rendezvous) or stop with
    a one-line error naming the missing ones. timeout_minutes bounds every collective after that
    (torch's default otherwise): the ranks wait in one while rank 0 writes a checkpoint, which on
    a slow shared filesystem can take minutes."""
    env = torchrun_env()
    device = resolve_device(device)
    if env is None:
        return False, 0, 1, device
    rank, world, local, addr, port = env
    cuda = device.startswith("cuda")
    if cuda and "LOCAL_RANK" not in os.environ:
        raise UserError("LOCAL_RANK is not set: on CUDA it picks each process's GPU; launch with "
                        "torchrun")
    if device == "cuda":
        device = f"cuda:{local}"
    if cuda:
        torch.cuda.set_device(device)
    store = rendezvous(rank, world, addr, port, rendezvous_minutes)
    timeout = {}
    if timeout_minutes:
        timeout["timeout"] = datetime.timedelta(minutes=timeout_minutes)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, **timeout)
    return True, rank, world, device


def wait_for_master(rank, addr, port, minutes, deadline):
    """Until something answers at addr:port, by a plain socket: TCPStore's own retries print C++
    stack traces while they wait."""
    while True:
        try:
            socket.create_connection((addr, port), timeout=5).close()
            return
        except socket.gaierror as e:
            raise rank_error(f"MASTER_ADDR={addr!r}: {e.strerror}") from None
        except OSError:
            if time.monotonic() > deadline:
                raise rank_error(f"rank {rank}: nothing answers at MASTER_ADDR:MASTER_PORT="
                                 f"{addr}:{port} after {minutes:g} minutes: is rank 0 running, "
                                 "and is that address reachable from here? "
                                 "(ddp_rendezvous_minutes)") from None
            time.sleep(0.2)


def rendezvous(rank, world, addr, port, minutes):
    """The TCPStore at MASTER_ADDR:MASTER_PORT, once all WORLD_SIZE processes have checked in
    there; after `minutes` without them a one-line error naming the ranks missing (torch alone
    waits its collective timeout, 30 minutes). Under torchrun its agent hosts the store; otherwise
    rank 0 does, as torch's env:// rendezvous."""
    deadline = time.monotonic() + 60 * minutes
    host = not rank and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    where = f"MASTER_ADDR:MASTER_PORT={addr}:{port}"
    if not host:
        wait_for_master(rank, addr, port, minutes, deadline)
    left = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
    try:
        store = dist.TCPStore(addr, port, world, is_master=host, wait_for_workers=False,
                              multi_tenant=True, timeout=left)
    except dist.DistError as e:
        first = str(e).splitlines()[0]
        raise rank_error(f"rank {rank}: no rendezvous at {where}: {first}") from None
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    keys = [f"lex-gpt/{restart}/joined/{r}" for r in range(world)]
    store.set(keys[rank], f"{world} {socket.gethostname()}")
    while True:  # polled: store.wait's timeout logs C++ warnings
        try:
            joined = [store.check([key]) for key in keys]
        except dist.DistError:  # rank 0's store went away: its own error says why
            raise rank_error(f"rank {rank}: the rendezvous at {where} closed (rank 0 stopped)") \
                from None
        if all(joined):
            break
        if time.monotonic() > deadline:
            missing = ", ".join(str(r) for r in range(world) if not joined[r])
            raise rank_error(f"rank {rank}: rank(s) {missing} of WORLD_SIZE={world} did not join "
                             f"at {where} within {minutes:g} minutes (ddp_rendezvous_minutes): "
                             "start them, or fix WORLD_SIZE",
                             quiet=rank != joined.index(True))  # said once, by the lowest rank
        time.sleep(0.1)
    worlds = [int(store.get(key).split()[0]) for key in keys]
    if worlds != [world] * world:
        said = ", ".join(f"rank {r}: {w}" for r, w in enumerate(worlds))
        raise UserError(f"the processes disagree on WORLD_SIZE ({said}): give every one the same")
    return store


def all_reduce_sum(t, ddp):
    if ddp:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)  # gloo has no AVG
    return t


HELD_UNTIL_EXIT = []  # see teardown_distributed


def teardown_distributed(ddp):
    """Leave the process group: a barrier whose handle this process keeps until it exits, then
    destroy_process_group.

    Why: gloo finishes each collective on a worker thread, and if that thread drops the last
    reference to the work while the interpreter shuts down, the process aborts ("terminate called
    without an active exception"). The barrier waits, with the GIL released, until every rank has
    finished, and its work holds every collective still in flight; keeping its handle to the end
    makes this thread, not a worker, the last to release them. A plain barrier is not enough.
    docs/engineering_notes.md has the whole story.
    """
    if ddp:
        barrier = dist.barrier(async_op=True)
        barrier.wait()
        HELD_UNTIL_EXIT.append(barrier)
        dist.destroy_process_group()
