"""
prepare_data.py's crash-safe writer of a dataset directory: each file written under a temporary
name, hashed as written, renamed to a name of its own and committed by replacing meta.json in one
atomic rename, so that a reader, or a kill at any instant, sees the complete old dataset or the
complete new one. Every name created in the directory is journaled first, so that the next run
removes what a killed one left and nothing else: a file the directory held before that neither
meta.json nor the journal names is someone else's. train.bin and val.bin are kept as hard links to
the current token files, for tools that read nanoGPT's names.
"""

import fcntl
import hashlib
import json
import os
import re
import secrets
from pathlib import Path

import numpy as np

from lexgpt.cli import UserError
from lexgpt.data import SPLITS, ends_sha256, meta_problem

JOURNAL = ".tmp-prepare_data-journal"
JOURNAL_HEADER = "prepare_data.py journal: files created here that meta.json may not name"
LINKS = tuple(f"{s}.bin" for s in SPLITS)  # nanoGPT's names, hard links to the current token files
# The only names a journal may list: a damaged or forged one can never name meta.json or a user's
# file.
JOURNALED = re.compile(r"\.tmp-prepare_data-[0-9a-f]{32}"
                       r"|(train|val)(_docs|_names|_answers)?-[0-9a-f]{12}\.(bin|jsonl)")


def journal(out_dir, *names):
    """Record names before they are created (flushed to disk): whatever a kill leaves, the next run
    knows it wrote."""
    with open(Path(out_dir) / JOURNAL, "a", encoding="utf-8") as f:
        f.write("".join(f"{n}\n" for n in (JOURNAL_HEADER,) * (f.tell() == 0) + names))
        f.flush()
        os.fsync(f.fileno())


def journaled(out_dir):
    """The names the journal lists, or None where there is no journal of ours."""
    try:
        lines = (Path(out_dir) / JOURNAL).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    if lines[:1] != [JOURNAL_HEADER]:
        return None
    return {n for n in lines[1:] if JOURNALED.fullmatch(n)}


def our_meta(out_dir):
    """out_dir's meta.json if it is a dataset of this project's, else None."""
    try:
        meta = json.loads((Path(out_dir) / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return None if meta_problem(meta) else meta


def owned(out_dir):
    """(our meta.json or None, the names in out_dir this project wrote): meta.json and the files it
    names, what the journal lists, and train.bin and val.bin where they are links to one of
    those."""
    meta, listed = our_meta(out_dir), journaled(out_dir)
    names = set(listed or ()) | ({JOURNAL} if listed is not None else set())
    if meta:
        names |= {"meta.json", *(entry["file"] for entry in meta["files"].values())}
    files = [out_dir / n for n in names if (out_dir / n).is_file()]
    names |= {n for n in LINKS
              if (out_dir / n).is_file() and any((out_dir / n).samefile(f) for f in files)}
    return meta, names


def settle(out_dir, relink=False):
    """Bring out_dir to its committed state: train.bin and val.bin made links to meta.json's token
    files (where they are ours, or always with relink), then every other file the journal lists
    removed, and the journal last."""
    meta, names = owned(out_dir)
    for split in SPLITS if meta else ():
        link, target = out_dir / f"{split}.bin", out_dir / meta["files"][split]["file"]
        if (relink or link.name in names) and not (link.is_file() and link.samefile(target)):
            tmp = out_dir / f".tmp-prepare_data-{secrets.token_hex(16)}"
            journal(out_dir, tmp.name)
            os.link(target, tmp)
            os.replace(tmp, link)
    keep = {*LINKS, *((entry["file"] for entry in meta["files"].values()) if meta else ())}
    for name in (journaled(out_dir) or set()) - keep:
        (out_dir / name).unlink(missing_ok=True)
    (out_dir / JOURNAL).unlink(missing_ok=True)


class Temporary:
    """A temporary file in out_dir, journaled, created as the umask allows, hashed as written
    (sha256 of its content)."""

    def __init__(self, out_dir, registry):
        path = Path(out_dir) / f".tmp-prepare_data-{secrets.token_hex(16)}"
        journal(out_dir, path.name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fd = os.open(path, flags, 0o666)  # less the umask
        registry.append(path)
        self.path, self.file, self.sha = path, os.fdopen(fd, "wb"), hashlib.sha256()

    def write(self, data):
        self.file.write(data)
        self.sha.update(data)

    def finish(self):
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return self.sha.hexdigest()


class SplitWriter:
    """One split's three files: tokens, the documents' [start, end) offsets (little-endian int64
    pairs), and their names (one JSON string a line), if named."""

    def __init__(self, out_dir, split, dtype, named, registry):
        self.split = split
        self.dtype = np.dtype(dtype)
        self.at = 0
        self.count = 0
        self.registry = registry
        self.tokens, self.offsets = Temporary(out_dir, registry), Temporary(out_dir, registry)
        self.names = Temporary(out_dir, registry) if named else None
        self.answers = None

    def add_tokens(self, array, answers=None):
        """Tokens, and for a task dataset a byte per token: 1 where it is an answer."""
        self.tokens.write(np.ascontiguousarray(array, dtype=self.dtype).tobytes())
        self.at += len(array)
        if answers is not None:
            self.answers = self.answers or Temporary(self.tokens.path.parent, self.registry)
            self.answers.write(np.ascontiguousarray(answers, dtype=np.uint8).tobytes())

    def add_documents(self, offsets, names=None):
        self.offsets.write(np.ascontiguousarray(offsets, dtype="<i8").tobytes())
        self.count += len(offsets)
        if self.names is not None:
            self.names.write("".join(json.dumps(n) + "\n" for n in names).encode())

    def finish(self):
        """{role: (temporary path, entry for meta.json's files)}."""
        out = {}
        for role, temp, size in ((self.split, self.tokens, {"tokens": self.at}),
                                 (f"{self.split}_docs", self.offsets, {"documents": self.count}),
                                 (f"{self.split}_names", self.names, {"documents": self.count}),
                                 (f"{self.split}_answers", self.answers, {"tokens": self.at})):
            if temp is not None:
                digest = temp.finish()
                suffix = "jsonl" if role.endswith("_names") else "bin"
                out[role] = temp.path, {"file": f"{role}-{digest[:12]}.{suffix}", **size,
                                        "ends_sha256": ends_sha256(temp.path), "sha256": digest}
        return out


def commit(out_dir, written, meta):
    """Rename each temporary to its own name (role and content hash), so the old dataset's files are
    never touched; then replace meta.json, which names the files, in one atomic rename: the commit.
    A kill at any instant leaves the complete old dataset or the complete new one; the next run
    removes what a killed run left behind (the new names and the old dataset's files are journaled
    first). train.bin and val.bin then become links to the new token files, for tools that read
    nanoGPT's names."""
    meta = dict(meta, files={role: entry for role, (_, entry) in written.items()})
    old = our_meta(out_dir)
    journal(out_dir, *(entry["file"] for _, entry in written.values()),
            *((entry["file"] for entry in old["files"].values()) if old else ()))
    for role, (tmp, entry) in written.items():
        os.replace(tmp, out_dir / entry["file"])
    registry = []
    meta_tmp = Temporary(out_dir, registry)
    meta_tmp.write((json.dumps(meta, indent=1) + "\n").encode())
    meta_tmp.finish()
    os.replace(meta_tmp.path, out_dir / "meta.json")
    settle(out_dir, relink=True)
    return meta


def write_dataset(out_dir, splits, meta):
    """A small dataset held in memory, written as prepare_data.py writes any: splits maps "train"
    and "val" to (token array, (n, 2) document offsets, names or None)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settle(out_dir)
    written, registry = {}, []
    for split, (tokens, offsets, names) in splits.items():
        writer = SplitWriter(out_dir, split, tokens.dtype, names is not None, registry)
        writer.add_tokens(tokens)
        writer.add_documents(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), names)
        written.update(writer.finish())
    return commit(out_dir, written, meta)


def take_out_dir(out_dir, allow_foreign):
    """Lock out_dir for this run (flock on the directory: a second prepare_data.py there would
    remove this one's temporaries) and refuse it if it holds files this project did not write (a
    user's, or nanoGPT's train.bin), unless allowed; then remove what a killed run left. Returns
    the open directory, which holds the lock."""
    fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"another prepare_data.py is writing to --out_dir {out_dir}: wait for it, "
                        "or choose another --out_dir") from None
    taken = [n for n in ("meta.json", *LINKS) if (out_dir / n).is_dir()]
    if taken:  # nothing replaces a directory: refused even with --allow_foreign_files
        os.close(fd)
        raise UserError(f"--out_dir {out_dir} holds a directory named {taken[0]}, a name the "
                        "dataset needs: move it")
    foreign = sorted(set(os.listdir(out_dir)) - owned(out_dir)[1])
    if foreign and not allow_foreign:
        os.close(fd)
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise UserError(f"--out_dir {out_dir} holds files prepare_data.py did not write "
                        f"({', '.join(foreign[:3])}{more}): choose a new or empty --out_dir, or "
                        "pass --allow_foreign_files to write there anyway (replacing its "
                        "meta.json, train.bin and val.bin, keeping the other files)")
    settle(out_dir)
    return fd
