# SPDX-License-Identifier: Apache-2.0
"""The offline Hugging Face cache the CPU suite runs against.

Upstream CPU tests build ``ModelConfig``/``VllmConfig`` objects for a handful of
hub model ids; that reads the model's ``config.json`` (and for a few tests its
tokenizer and processor files) from the hub. The suite must run without network
and must not lose those tests, so the project carries the files they read under
``data/hf-fixtures/<org>/<name>/`` (written from the models' public
``config.json``; no weights) and ``materialize`` lays them out as a hub cache:

    <HF_HOME>/hub/models--<org>--<name>/refs/main        -> <revision>
    <HF_HOME>/hub/models--<org>--<name>/snapshots/<revision>/<files>

Files too big to carry are generated (``GENERATED``): llava-1.5's
``tokenizer.json`` is a Llama-style byte-fallback BPE with the real model's
special-token ids (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``<image>`` 32000,
``<pad>`` 32001) and vocabulary size (32000 + 2 added), but no merges: text
tokenizes to characters/bytes. The tests only load it and use token ids.

``<revision>`` is a hash of the fixture's files, so the cache is rebuilt when a
fixture changes. ``offline_env`` gives the variables that make huggingface_hub
and transformers read only that cache (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

FIXTURES_DIR = Path(__file__).parent / "data" / "hf-fixtures"
GENERATOR_VERSION = "1"


def _special(i: int, content: str) -> dict:
    return {
        "id": i,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }


def llama_tokenizer_json(
    vocab_size: int = 32000, added: tuple[str, ...] = ("<image>", "<pad>")
) -> bytes:
    """A loadable Llama-style tokenizer.json (byte-fallback BPE, no merges)."""
    vocab: dict[str, int] = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in ["\u2581", *map(chr, range(33, 127))]:
        vocab.setdefault(ch, len(vocab))
    while len(vocab) < vocab_size:
        vocab[f"<unused{len(vocab)}>"] = len(vocab)
    added_tokens = [_special(0, "<unk>"), _special(1, "<s>"), _special(2, "</s>")]
    added_tokens += [_special(vocab_size + i, t) for i, t in enumerate(added)]
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    data = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "\u2581"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
            ],
        },
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                bos,
                {"Sequence": {"id": "A", "type_id": 0}},
                bos,
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        },
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }
    return json.dumps(data, ensure_ascii=False).encode()


# repo id -> file name -> generator
GENERATED: dict[str, dict[str, Callable[[], bytes]]] = {
    "llava-hf/llava-1.5-7b-hf": {"tokenizer.json": llama_tokenizer_json},
}


def fixture_repos(fixtures: Path = FIXTURES_DIR) -> list[str]:
    """The ``org/name`` ids the fixture data holds files for."""
    return sorted(
        f"{d.parent.name}/{d.name}"
        for d in fixtures.glob("*/*")
        if d.is_dir() and any(p.is_file() for p in d.rglob("*"))
    )


def _files(repo_dir: Path) -> list[Path]:
    return sorted(p for p in repo_dir.rglob("*") if p.is_file())


def revision(repo_dir: Path, generated: tuple[str, ...] = ()) -> str:
    """A 40-hex revision derived from the fixture's files and generated names."""
    h = hashlib.sha1()
    for p in _files(repo_dir):
        h.update(p.relative_to(repo_dir).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    for name in sorted(generated):
        h.update(f"generated:{GENERATOR_VERSION}:{name}\0".encode())
    return h.hexdigest()


def materialize(hf_home: Path, fixtures: Path = FIXTURES_DIR) -> list[str]:
    """Lay the fixtures out as a hub cache under ``hf_home``; return the repo ids.

    Idempotent; a repo folder whose revision is stale is replaced.
    """
    hub = hf_home / "hub"
    hub.mkdir(parents=True, exist_ok=True)
    repos = fixture_repos(fixtures)
    for repo in repos:
        src = fixtures / repo
        generated = GENERATED.get(repo, {})
        rev = revision(src, tuple(generated))
        dest = hub / ("models--" + repo.replace("/", "--"))
        ref = dest / "refs" / "main"
        snap = dest / "snapshots" / rev
        if ref.is_file() and ref.read_text().strip() == rev and snap.is_dir():
            continue
        if dest.exists():
            shutil.rmtree(dest)
        for p in _files(src):
            target = snap / p.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, target)
        for name, make in generated.items():
            (snap / name).write_bytes(make())
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(rev)
    return repos


def offline_env(hf_home: Path) -> dict[str, str]:
    """Environment that points huggingface_hub/transformers at the cache, offline."""
    return {
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
