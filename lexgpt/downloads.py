"""
Downloads for prepare_data.py's url sources: each URL fetched once into a cache folder, retried
through urllib3 on a failed connection, a timeout, HTTP 408, 429 or 5xx, or a body that breaks off.
"""

import hashlib
import os
import re
import sys
from pathlib import Path

from lexgpt.cli import UserError

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
