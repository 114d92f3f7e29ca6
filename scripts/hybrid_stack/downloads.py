# SPDX-License-Identifier: Apache-2.0
"""Downloads from the package index, verified: what `fetch`, `apply`, `build`
and `rebase` share.

The files come from the package index pip is configured with (PIP_INDEX_URL,
pip's config files, else pip's own default), through the index's standard
simple API (PEP 691 JSON, or PEP 503 HTML), and land in the user cache
(`$HYBRID_STACK_CACHE`, default `~/.cache/hybrid-stack/dist`). A cached file
whose sha256 matches the pin is used without asking the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

from hybrid_stack.errors import StackError
from hybrid_stack.proc import crash_point, pid_tag, sweep_stale
from hybrid_stack.stack import Artifact, Stack, cache_dir

ACCEPT = (
    "application/vnd.pypi.simple.v1+json, "
    "application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"
)
CHUNK = 1 << 20


def dist_dir() -> Path:
    return cache_dir() / "dist"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def pip_indexes() -> list[str]:
    """Index URLs in pip's order: index-url first, then extra-index-urls."""
    index = os.environ.get("PIP_INDEX_URL", "")
    extra = os.environ.get("PIP_EXTRA_INDEX_URL", "").split()
    if not index or "PIP_EXTRA_INDEX_URL" not in os.environ:
        cfg = _pip_config()
        index = index or cfg.get("index-url", "")
        if "PIP_EXTRA_INDEX_URL" not in os.environ:
            extra = cfg.get("extra-index-url", "").split()
    if not index:
        from pip._internal.models.index import PyPI  # pip's own default

        index = PyPI.simple_url
    return [index, *extra]


def _pip_config() -> dict[str, str]:
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found: dict[str, str] = {}
    # later sections override earlier ones as in pip: global < download
    for section in ("global", "download"):
        for line in out.splitlines():
            key, _, value = line.partition("=")
            sec, _, name = key.partition(".")
            if sec == section and name in ("index-url", "extra-index-url"):
                found[name] = value.strip().strip("'\"")
    return found


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (text, href)
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href is not None:
            self.links.append((data.strip(), self._href))
            self._href = None


def _open(url: str, timeout: float = 120):
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        path = Path(urllib.request.url2pathname(parsed.path))
        if path.is_dir():
            path = path / "index.html"
        return path.open("rb"), "text/html"
    req = urllib.request.Request(url, headers={"Accept": ACCEPT})
    resp = urllib.request.urlopen(req, timeout=timeout)
    return resp, resp.headers.get("Content-Type", "")


def index_files(index: str, project: str) -> dict[str, tuple[str, str]]:
    """file name -> (download URL, sha256 announced by the index or '') for
    every file the index lists for ``project``."""
    page = index.rstrip("/") + f"/{project}/"
    try:
        f, ctype = _open(page)
        with f:
            body = f.read()
    except (urllib.error.URLError, OSError) as e:
        raise StackError(f"cannot read the index page {page}: {e}") from None
    files: dict[str, tuple[str, str]] = {}
    if "json" in ctype:
        for item in json.loads(body).get("files", []):
            sha = item.get("hashes", {}).get("sha256", "")
            files[item["filename"]] = (urllib.parse.urljoin(page, item["url"]), sha.lower())
    else:
        parser = _Links()
        parser.feed(body.decode("utf-8", "replace"))
        for text, href in parser.links:
            url, _, frag = href.partition("#")
            name = text or Path(urllib.parse.urlparse(url).path).name
            sha = frag.split("=", 1)[1] if frag.startswith("sha256=") else ""
            files[name] = (urllib.parse.urljoin(page, url), sha.lower())
    return files


def find_file_url(index: str, project: str, filename: str) -> tuple[str, str]:
    """(download URL, sha256 announced by the index or '') for one file."""
    files = index_files(index, project)
    if filename not in files:
        page = index.rstrip("/") + f"/{project}/"
        raise StackError(f"{filename} is not listed on {page}")
    return files[filename]


def download(url: str, dest: Path) -> None:
    """Download into `<dest>.part-<pid>-` and rename it to dest when complete;
    parts of killed downloads are removed first."""
    sweep_stale(dest.parent, f"{dest.name}.part-")
    part = dest.with_name(f"{dest.name}.part{pid_tag()}")
    try:
        src, _ = _open(url, timeout=300)
        total = int(getattr(src, "headers", {}).get("Content-Length", 0) or 0)
        done, last = 0, -1
        with src, part.open("wb") as out:
            while block := src.read(CHUNK):
                out.write(block)
                crash_point("download")
                done += len(block)
                pct = done * 100 // total if total else -1
                if total and pct // 10 != last // 10:
                    print(f"  {dest.name}: {done >> 20}/{total >> 20} MiB ({pct}%)")
                    last = pct
        part.replace(dest)
    except (urllib.error.URLError, OSError) as e:
        part.unlink(missing_ok=True)
        raise StackError(f"download of {url} failed: {e}") from None


def download_verified(url: str, dest: Path, sha256: str, whose: str, hint: str) -> None:
    """``download``, then check the file against ``sha256`` (``whose`` hash it
    is, for the message); a mismatch is moved aside and raised."""
    download(url, dest)
    got = sha256_file(dest)
    if got != sha256:
        bad = dest.with_name(dest.name + ".sha256-mismatch")
        dest.replace(bad)
        raise StackError(
            f"{dest.name}: downloaded sha256 {got} != {whose} {sha256} (kept as {bad}); {hint}"
        )


def fetch_artifact(stack: Stack, kind: str = "sdist", offline: bool = False) -> Path:
    """Return the verified cached path of the pinned sdist or wheel."""
    art: Artifact | None = getattr(stack.pin, kind)
    if art is None:
        raise StackError(f"patches/pin.toml pins no {kind}: add upstream.{kind}")
    dest = dist_dir() / art.filename
    if dest.is_file():
        got = sha256_file(dest)
        if got == art.sha256:
            return dest
        _cached_mismatch(stack, art, dest, got, offline)  # raises, or moves dest aside
    if offline:
        raise StackError(f"{art.filename} is not in the cache ({dest.parent}); run fetch")
    dest.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for index in pip_indexes():
        try:
            url, announced = find_file_url(index, stack.pin.project, art.filename)
        except StackError as e:
            errors.append(str(e))
            continue
        if announced and announced != art.sha256:
            raise StackError(
                f"the index announces sha256 {announced} for {art.filename}, "
                f"the pin says {art.sha256}: check the pin"
            )
        print(f"fetch: {art.filename} from {urllib.parse.urlparse(url).netloc or url}")
        download_verified(url, dest, art.sha256, "pinned", "check the pin and the index")
        return dest
    raise StackError(f"{art.filename} not found on any configured index: " + "; ".join(errors))


def _announced(stack: Stack, filename: str) -> str:
    """The sha256 the first index that lists `filename` announces ('' if none)."""
    for index in pip_indexes():
        try:
            return find_file_url(index, stack.pin.project, filename)[1]
        except StackError:
            continue
    return ""


def _cached_mismatch(stack: Stack, art: Artifact, dest: Path, got: str, offline: bool) -> None:
    """A cached file whose sha256 is not the pin's: say which side is wrong,
    asking the index where it can. A damaged file (the index agrees with the
    pin) is moved aside so that fetch downloads it again; otherwise raise."""
    announced = "" if offline else _announced(stack, art.filename)
    if announced and announced == got:
        raise StackError(
            f"patches/pin.toml's sha256 for {art.filename} is wrong: it says "
            f"{art.sha256}, but the cached file and the index both have {got}; "
            "fix the pin"
        )
    if announced and announced == art.sha256:
        bad = dest.with_name(dest.name + ".sha256-mismatch")
        dest.replace(bad)
        print(
            f"fetch: cached {dest.name} is damaged (sha256 {got[:12]}..., the pin and "
            f"the index say {art.sha256[:12]}...): kept as {bad.name}, downloading again"
        )
        return
    if announced:
        raise StackError(
            f"{art.filename}: the pin says sha256 {art.sha256}, the index {announced}, "
            f"the cached {dest} has {got}: check the pin against the release's "
            "published hash, then delete the cached file and fetch again"
        )
    how = "offline" if offline else "no index announces its hash"
    raise StackError(
        f"cached {dest} has sha256 {got}, the pin says {art.sha256} ({how}, so "
        "which is wrong is not known): compare the pin with the release's published "
        "sha256; if the pin is right, delete the cached file and fetch again"
    )
