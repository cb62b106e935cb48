"""Which LM-head rows a trimmed draft head keeps (FR-Spec / VocabTrim): the N tokens most frequent
in text counted offline with the bundle's tokenizer, plus every added (special, control) token,
the EOS ids and BOS, whatever their count.

Frequency sources (export --draft-vocab-from, comma-separated, in any mix):
- stdlib: the .py sources of the running Python's standard library (test suites, IDLE and
  site-packages left out), text every machine with Python has and nobody has to download;
- docs: this project's Markdown (README.md, BENCHMARKS.md, docs/, benchmarks/notes/), found next to the export package;
- a file or folder path: every UTF-8 text file in it (hidden folders skipped).
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SUGGESTED_DRAFT_VOCAB = 32768
DEFAULT_SOURCES = ("stdlib", "docs")
_REPO = Path(__file__).resolve().parent.parent
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
_BATCH = 64  # files per tokenizer call: bounded memory, whatever the corpus size


class TrimError(ValueError):
    """A frequency source or a draft vocabulary size that cannot be used, in words."""


@dataclass(frozen=True)
class Corpus:
    files: tuple[Path, ...]
    description: str  # what was read, for the manifest's counted_from


def _text_files(folder: Path, skip=frozenset()) -> list[Path]:
    found = []
    for path in sorted(folder.rglob("*")):
        parts = path.relative_to(folder).parts
        if path.is_file() and not any(p.startswith(".") or p in skip for p in parts[:-1]):
            found.append(path)
    return found


def corpus(sources: tuple[str, ...]) -> Corpus:
    """The files each source names, refused by name when a source has none."""
    if not sources:
        raise TrimError(f"--draft-vocab-from names no source; use {','.join(DEFAULT_SOURCES)} or a path")
    files, parts = [], []
    for source in sources:
        if source == "stdlib":
            root = Path(sysconfig.get_paths()["stdlib"])
            found = [p for p in _text_files(root, _STDLIB_SKIP) if p.suffix == ".py"]
            label = f"stdlib (Python {sysconfig.get_python_version()}, {len(found)} .py files)"
        elif source == "docs":
            found = [p for p in (_REPO / "README.md", _REPO / "BENCHMARKS.md") if p.is_file()]
            for folder in (_REPO / "docs", _REPO / "benchmarks" / "notes"):  # the dated measurements moved to notes/
                found += [p for p in _text_files(folder) if p.suffix == ".md"] if folder.is_dir() else []
            label = f"docs (edge-spec Markdown, {len(found)} files)"
        else:
            path = Path(source)
            if not path.exists():
                raise TrimError(f"--draft-vocab-from {source!r}: no such file or folder (sources: stdlib, docs, or a path)")
            found = [path] if path.is_file() else _text_files(path)
            label = f"{source} ({len(found)} files)"
        if not found:
            raise TrimError(f"--draft-vocab-from {source!r}: no text files there")
        files += found
        parts.append(label)
    return Corpus(tuple(dict.fromkeys(files)), ", ".join(parts))


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # a binary or unreadable file in a folder source: not text, not counted


def count_tokens(backend, files: tuple[Path, ...], n_tokens: int) -> tuple[np.ndarray, int]:
    """Occurrences of each token id [n_tokens] in the files, tokenized without added specials
    by a `tokenizers.Tokenizer`; and how many files were text."""
    counts = np.zeros(n_tokens, dtype=np.int64)
    read = 0
    for begin in range(0, len(files), _BATCH):
        texts = [t for t in map(_read, files[begin : begin + _BATCH]) if t]
        read += len(texts)
        for encoding in backend.encode_batch(texts, add_special_tokens=False):
            ids = np.asarray(encoding.ids, dtype=np.int64)
            counts += np.bincount(ids[ids < n_tokens], minlength=n_tokens)
    return counts, read


def always_kept(tokenizer, eos_ids, bos_id) -> set[int]:
    """Every added token (special and control tokens: chat markers, FIM, EOS) and BOS/EOS."""
    kept = {int(i) for i in tokenizer.backend_tokenizer.get_added_tokens_decoder()}
    kept.update(int(i) for i in eos_ids)
    if bos_id is not None:
        kept.add(int(bos_id))
    return kept


def choose_rows(counts: np.ndarray, n: int, forced: set[int]) -> np.ndarray:
    """The n token ids to keep, ascending: `forced` first, then by count (ties: lower id)."""
    if len(forced) > n:
        raise TrimError(f"--draft-vocab {n} is smaller than the {len(forced)} special and EOS tokens a trimmed head always keeps")
    order = np.lexsort((np.arange(len(counts)), -counts))  # most frequent first
    rest = [int(i) for i in order if int(i) not in forced][: n - len(forced)]
    return np.array(sorted(forced | set(rest)), dtype=np.int32)


def kept_mass(counts: np.ndarray, rows: np.ndarray) -> float:
    """The share of the counted tokens the kept rows cover."""
    total = int(counts.sum())
    return float(counts[rows].sum()) / total if total else 0.0
