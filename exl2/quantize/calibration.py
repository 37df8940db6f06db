"""Calibration and evaluation text, and turning it into rows of token ids (spec EXL2.md §3.3).

The built-in calibration set needs no network: it is harvested from what every Python installation ships — English
docstrings and source code of the standard library, plus the READMEs (dist-info METADATA) and licenses of the
installed packages — in a seeded, deterministic order, plus a few rows of uniformly random tokens as exllamav2 adds.

The built-in evaluation text is the Python documentation in `pydoc_data.topics`, which the calibration harvest never
reads; where a distribution strips that module, a fixed tenth of the standard-library modules (chosen by a hash of
the path) is held out instead, and the calibration harvest always skips that tenth. The two sets are therefore
disjoint by construction.
"""
from __future__ import annotations

import ast
import functools
import json
import random
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from exl2.errors import ConfigError

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "pydoc_data", "__pycache__"}
_SHARES = (("prose", 0.45), ("code", 0.30), ("docs", 0.25))


@dataclass
class Calibration:
    ids: torch.Tensor          # [rows, length] int64
    dataset: str               # basename of the data file, or "(default)"


def _held_out(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % 10 == 0


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[tuple[str, Path], ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if set(rel.split("/")[:-1]) & _EXCLUDED_DIRS:
            continue
        out.append((rel, path))
    out.sort()
    return tuple(out)


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _docstrings(source: str) -> str:
    """The module's docstrings (module, classes, functions) as paragraphs of English text."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) > 80:
                parts.append(doc)
    return "\n\n".join(parts)


def _metadata_body(text: str) -> str:
    """The long description of a dist-info METADATA file (what follows the header block)."""
    head, sep, body = text.partition("\n\n")
    return body.strip() if sep else ""


def _package_docs() -> list[Path]:
    roots = {Path(p) for key in ("purelib", "platlib") if (p := sysconfig.get_paths().get(key))}
    files = []
    for root in sorted(roots):
        if root.is_dir():
            files += sorted(root.glob("*.dist-info/METADATA"))
            files += sorted(p for p in root.glob("*.dist-info/**/*") if p.is_file() and p.name.upper().startswith(
                ("LICENSE", "LICENCE", "COPYING", "NOTICE")))
    stdlib_license = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if stdlib_license.is_file():
        files.append(stdlib_license)
    return files


def _documents(category: str, seed: int) -> Iterator[str]:
    """An endless-enough, deterministic stream of documents of one category."""
    rng = random.Random(f"{category}:{seed}")
    if category == "docs":
        paths = _package_docs()
        rng.shuffle(paths)
        for p in paths:
            text = _read(p)
            if text and p.name == "METADATA":
                text = _metadata_body(text)
            if text and len(text) > 200:
                yield text
        return
    files = [(rel, p) for rel, p in _stdlib_files() if not _held_out(rel)]
    rng.shuffle(files)
    for _, p in files:
        text = _read(p)
        if not text:
            continue
        if category == "prose":
            text = _docstrings(text)
        if len(text) > 200:
            yield text


def heldout_text() -> str:
    """Built-in evaluation text: the pydoc topics (or the held-out tenth of stdlib docstrings)."""
    try:
        from pydoc_data.topics import topics
        return "\n\n".join(topics[k].strip() for k in sorted(topics))
    except ImportError:
        parts = [_docstrings(_read(p) or "") for rel, p in _stdlib_files() if _held_out(rel)]
        return "\n\n".join(p for p in parts if p)


def _token_stream(docs: Iterator[str], encode: Callable[[str], list[int]], eos: Optional[int],
                  needed: int) -> list[int]:
    buf: list[int] = []
    for doc in docs:
        buf += encode(doc)
        if eos is not None:
            buf.append(eos)
        if len(buf) >= needed:
            break
    return buf[:needed]


def random_rows(rows: int) -> int:
    """Rows of uniformly random tokens at the end of a built-in set of `rows` rows (exllamav2 adds two)."""
    return min(2, rows // 8)


def builtin_calibration(tokenizer, rows: int, length: int, vocab_size: int, seed: int = 0) -> Calibration:
    """`rows` rows of `length` tokens: prose / code / package docs in fixed shares, plus ≤ 2 random-token rows.

    For models whose prompts start with BOS, every other text row does too (like half of exllamav2's wiki rows).
    """
    if rows < 1 or length < 2:
        raise ConfigError("Calibration needs at least one row of at least two tokens.")
    n_random = random_rows(rows)
    n_text = rows - n_random
    counts = [int(n_text * share) for _, share in _SHARES]
    for i in range(n_text - sum(counts)):
        counts[i % len(counts)] += 1
    bos = tokenizer.bos_id if getattr(tokenizer, "add_bos", False) else None
    eos = next(iter(sorted(getattr(tokenizer, "eos_ids", set()) or [])), None)
    encode = lambda text: tokenizer.encode(text, add_bos=False, special=False)
    out: list[list[int]] = []
    for (category, _), count in zip(_SHARES, counts):
        if count == 0:
            continue
        stream = _token_stream(_documents(category, seed), encode, eos, count * length)
        if len(stream) < count * length:
            # Tiny installations: fall back to the other text categories rather than short rows.
            stream += _token_stream(_documents("code", seed + 1), encode, eos, count * length - len(stream))
        if len(stream) < count * length:
            raise ConfigError("This Python installation has too little text for the built-in calibration set; "
                              "pass a data file with -c.")
        for r in range(count):
            out.append(stream[r * length:(r + 1) * length])
    order = list(range(len(out)))
    random.Random(seed).shuffle(order)
    rows_ids = [out[i] for i in order]
    if bos is not None:
        for r in range(1, len(rows_ids), 2):
            rows_ids[r] = [bos] + rows_ids[r][:-1]
    ids = torch.tensor(rows_ids, dtype=torch.int64).view(-1, length)
    if n_random:
        gen = torch.Generator().manual_seed(seed + 4242)
        ids = torch.cat([ids, torch.randint(0, vocab_size, (n_random, length), generator=gen)])
    return Calibration(ids, "(default)")


def read_texts(path: Path | str) -> list[str]:
    """Documents of a user data file: .parquet (the `text` column, else all string columns joined by a space, as
    exllamav2 does), .jsonl (the `text` field, else all string fields), or .txt (the whole file)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"Calibration/evaluation file {p} does not exist.")
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
            table = pq.read_table(p)
        except Exception as e:  # pyarrow raises several error types for bad files
            raise ConfigError(f"{p} cannot be read as Parquet ({e}).") from None
        cols = table.column_names
        if "text" in cols:
            return [str(v) for v in table.column("text").to_pylist() if v]
        data = table.to_pylist()
        return [" ".join(str(v) for v in row.values() if isinstance(v, str)) for row in data]
    if suffix in (".jsonl", ".json"):
        texts = []
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                raise ConfigError(f"{p} line {n} is not valid JSON.") from None
            if isinstance(obj, str):
                texts.append(obj)
            elif isinstance(obj, dict):
                texts.append(obj["text"] if isinstance(obj.get("text"), str)
                             else " ".join(v for v in obj.values() if isinstance(v, str)))
        return texts
    if suffix in (".txt", ".text", ".md", ""):
        try:
            return [p.read_text(encoding="utf-8")]
        except UnicodeDecodeError:
            raise ConfigError(f"{p} is not UTF-8 text.") from None
    raise ConfigError(f"Unsupported data file {p.name}: use .parquet, .jsonl or .txt.")


def rows_from_texts(texts: list[str], tokenizer, rows: int, length: int, what: str = "calibration"
                    ) -> tuple[torch.Tensor, Optional[str]]:
    """Concatenate the texts' tokens (no BOS) and cut `rows × length`; fewer rows (with a warning) if short."""
    encode = lambda text: tokenizer.encode(text, add_bos=False, special=False)
    stream: list[int] = []
    for text in texts:
        stream += encode(text)
        if len(stream) >= rows * length:
            break
    have = min(rows, len(stream) // length)
    if have == 0:
        raise ConfigError(f"The {what} data holds only {len(stream)} tokens, less than one row of {length}.")
    warning = None
    if have < rows:
        warning = f"the {what} data holds only {len(stream)} tokens, enough for {have} of {rows} rows"
    return torch.tensor(stream[:have * length], dtype=torch.int64).view(have, length), warning


def user_calibration(path: Path | str, tokenizer, rows: int, length: int) -> tuple[Calibration, Optional[str]]:
    ids, warning = rows_from_texts(read_texts(path), tokenizer, rows, length)
    return Calibration(ids, Path(path).name), warning
