"""
What every script's command line shares, without importing torch: the one-line errors printed
instead of tracebacks (once per torchrun job), Ctrl-C's exit, seed checks, and the parent-death
signal for worker processes.
"""

import argparse
import ctypes
import os
import signal
import sys
import time

LIBC = None
if sys.platform.startswith("linux"):
    LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here, before any fork


def die_with_parent(parent):
    """In a child process: Linux sends it SIGKILL when its parent dies, however the parent dies
    (prctl's PR_SET_PDEATHSIG); if the parent (pid `parent`) died before this call, no signal
    will come, so it dies now. A no-op elsewhere."""
    if LIBC is None:
        return
    LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


class UserError(Exception):
    """A bad input from the user: scripts print it as one line and exit with status 1."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's errors as the project's: one line and status 1 (each script's main prints it),
    not the usage and status 2."""

    def error(self, message):
        raise UserError(message)


# The one seed rule, for the scripts' --seed and train.py's seed key (configurator.SEED)
SEED_RULE = "an integer from 0 to 2**63 - 1"


def is_seed(seed: object) -> bool:
    """Whether both torch.manual_seed and numpy's SeedSequence take seed (numpy refuses negative
    seeds, torch those of 2^64 and over; 2^63 leaves room for seed + rank): SEED_RULE."""
    return isinstance(seed, int) and 0 <= seed < 2**63


def check_seed(seed: object, flag: str = "--seed") -> int:
    """seed if is_seed, else a one-line error."""
    if not is_seed(seed):
        raise UserError(f"{flag} {seed} is not allowed: must be {SEED_RULE}")
    return seed


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_env():
    """None without torchrun (no RANK); else (rank, world, local_rank, master_addr, master_port),
    checked: RANK set alone (`RANK=0 python train.py`) or a malformed variable is a one-line
    error, not torch's ValueError. LOCAL_RANK (0 if unset) only picks the GPU:
    distributed.setup_distributed asks for it on CUDA."""
    if "RANK" not in os.environ:
        return None
    # LOCAL_RANK may be missing: only CUDA needs it
    missing = [v for v in TORCHRUN_VARS if not os.environ.get(v) and v != "LOCAL_RANK"]
    if missing:
        raise UserError(f"RANK={os.environ['RANK']!r} is set but not {', '.join(missing)}: "
                        "launch with torchrun, which sets them all, or unset RANK for a single "
                        "process")
    values = {v: os.environ.get(v, "0") for v in TORCHRUN_VARS}
    numbers = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    try:
        rank, world, local, port = (int(values[v]) for v in numbers)
    except ValueError:
        rank = world = local = port = -1
    if not (0 <= rank < world and local >= 0 and 0 < port < 65536):
        given = ", ".join(f"{k}={v!r}" for k, v in values.items())
        raise UserError(f"the torchrun variables {given} do not fit: integers with "
                        "0 <= RANK < WORLD_SIZE, LOCAL_RANK >= 0 and 0 < MASTER_PORT < 65536")
    return rank, world, local, values["MASTER_ADDR"], port


def launch_rank():
    """torchrun's RANK for this process, 0 without torchrun or where its variables do not fit
    (then each process prints torchrun_env's error itself)."""
    try:
        env = torchrun_env()
    except UserError:
        return 0
    if env is None:
        return 0
    return env[0]


QUIET_EXIT_SECONDS = 3


def rank_error(message, quiet=False):
    """A UserError that error_exit prints (quiet=False) or not whatever this process's rank: for
    an error that one rank alone knows of."""
    error = UserError(str(message))
    error.quiet = quiet
    return error


def error_exit(script, error):
    """Exit with status 1 and the one-line error, printed by one process under torchrun: rank 0,
    since the ranks check the same inputs and would print it once each, while the others exit
    quietly. An error that one rank alone may know of says itself whether to print (rank_error)."""
    quiet = getattr(error, "quiet", None)
    if quiet is None:
        quiet = launch_rank() > 0
    if quiet:  # torchrun stops every rank once one has exited: give rank 0 the time to print
        time.sleep(QUIET_EXIT_SECONDS)
        sys.exit(1)
    sys.exit(f"{script}: error: {error}")


def exit_interrupted(script, kept):
    """Ctrl-C (KeyboardInterrupt): one line saying what was kept (kept(), from rank 0 alone under
    torchrun) and exit status 130, as a shell reports it. In a process group, os._exit: tearing
    gloo down with a collective cut short aborts the process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while kept() looks: no traceback
    if launch_rank() == 0:
        print(f"{script}: interrupted (Ctrl-C): {kept()}", file=sys.stderr, flush=True)
    dist = sys.modules.get("torch.distributed")  # not imported: no process group either
    if dist is not None and dist.is_initialized():
        sys.stdout.flush()
        os._exit(130)
    sys.exit(130)
