"""
A training run's directory (out_dir): one process owns it at a time; its log.jsonl (open_log)
equals the uninterrupted run's after any number of kills and resumes; kept checkpoints are put in
place by renames; and a failed start leaves it as it was.
"""

import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from lexgpt.cli import UserError, launch_rank

# One owner: an advisory lock on out_dir/lock (flock), which the kernel drops when its process dies
LOCK_NAME = "lock"
OWNED = {}  # lock file -> descriptor (None: no locks there), held until release_run_dirs


def own_run_dir(folder, what="out_dir", advice="or give another out_dir"):
    """Take out_dir for this process, or a one-line error naming its owner (pid and host, written
    in the lock file): two trainers in one directory would rename each other's checkpoints away. A
    lock left by a dead process is free (flock locks die with their process), so it is taken over.
    Where the filesystem has no locks, a note and no lock."""
    path = Path(folder) / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = lock_owner(fd)
            os.close(fd)
            raise UserError(f"{what} {folder} is in use by {owner}: one process at a time writes "
                            f"a run; wait for it to end or stop it, {advice}") from None
        except OSError as e:
            os.close(fd)
            print(f"note: {what} {folder} cannot be locked ({e.strerror}): nothing stops a "
                  "second trainer there")
            OWNED[path] = None
            return
        # the owner before us removes the file as it lets go: ours must still be the one at path
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    script = Path(sys.argv[0]).name
    line = f"pid {os.getpid()} on host {socket.gethostname()} ({script})\n".encode()
    # in one write: a reader sees a whole line, old or new
    os.pwrite(fd, line.ljust(os.fstat(fd).st_size), 0)
    os.ftruncate(fd, len(line))
    OWNED[path] = fd


def lock_owner(fd):
    """The owner's line in a lock file. A new owner writes it just after it locks: an empty file
    gets a moment."""
    for _ in range(100):
        owner = os.pread(fd, 200, 0).decode(errors="replace").strip()
        if owner:
            return owner
        time.sleep(0.01)
    return "another process"


def release_run_dirs():
    """Let go of every run directory this process owns (removing the lock file first, so that
    none is left behind)."""
    while OWNED:
        path, fd = OWNED.popitem()
        if fd is not None:
            try:
                path.unlink(missing_ok=True)
            finally:
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


def open_log(path, start_iter):
    """A JSON-lines log opened for appending, kept only up to start_iter: the entries from
    start_iter on (which a resumed run writes again) and any line a kill cut short are dropped, so
    that after any number of kills and resumes the log equals the uninterrupted run's; start_iter 0
    starts it afresh. Rewritten by a rename, never half-written."""
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


def kept_checkpoints(ckpt_path):
    """The checkpoints keep_checkpoint writes beside ckpt.pt (ckpt_<iter>.pt, ckpt_best.pt); any
    other file in out_dir, a ckpt_backup.pt included, is the user's and never removed."""
    found = []
    for p in ckpt_path.parent.glob("ckpt_*.pt"):
        name = p.stem[5:]
        if name == "best" or (len(p.stem) == 12 and name.isdigit()):
            found.append(p)
    return sorted(found)


def clear_run_dir(ckpt_path, fresh):
    """Before a run's first step: debris of a killed run (a stale ckpt.pt.tmp), and for a fresh
    run an overwritten run's checkpoints, at once, so that out_dir never pairs the new log with
    them."""
    ckpt_path.with_name("ckpt.pt.tmp").unlink(missing_ok=True)
    if fresh:
        for old in [ckpt_path, *kept_checkpoints(ckpt_path)]:  # the latest, the kept, the best
            old.unlink(missing_ok=True)


def keep_checkpoint(path, iter_num, keep, best):
    """Keep the checkpoint just written at path as ckpt_<iter_num>.pt, and as ckpt_best.pt when
    best, removing all but the `keep` latest ckpt_<iter>.pt: hard links where the filesystem has
    them (no second copy on disk), else copies; each put in place by a rename, so that a kill never
    leaves one half-written."""
    path = Path(path)
    names = [f"ckpt_{iter_num:07d}.pt"]
    if best:
        names.append("ckpt_best.pt")
    for name in names:
        target, tmp = path.with_name(name), path.with_name(name + ".tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copyfile(path, tmp)
        os.replace(tmp, target)
    for old in sorted(path.parent.glob("ckpt_[0-9]*.pt"))[:-keep]:
        old.unlink()


def remove_debris(out_dir, made):
    """After a run failed before its first checkpoint: its empty log.jsonl (beside no checkpoint)
    while it still owns out_dir, then out_dir's lock let go, then out_dir itself when this run made
    it and it is empty, so that a failed start leaves the directory as it found it. A run refused
    out_dir removes no log: the owner's is empty too when it has just started."""
    if launch_rank() != 0:  # rank 0 alone writes there
        return
    out_dir = Path(out_dir)
    log = out_dir / "log.jsonl"
    # best effort: an out_dir that cannot be read (a name too long, a loop) has nothing to clean
    try:
        if out_dir / LOCK_NAME in OWNED and log.is_file() and log.stat().st_size == 0 \
                and not (out_dir / "ckpt.pt").exists():
            log.unlink()
        release_run_dirs()
        if made and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
    except OSError:
        pass
