"""The text files a corpus is read from: every file named, or found under a
folder named, with a common text suffix, in a deterministic order; read as
UTF-8 text, binary and undecodable files left out.  Medusa's training
corpus and the draft vocabulary's token counts both read them."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from forerun.errors import ConfigError, ModelNotFoundError

TEXT_SUFFIXES = {".py", ".pyi", ".txt", ".md", ".rst", ".c", ".h", ".cc", ".cpp", ".js",
                 ".ts", ".java", ".go", ".rs", ".json", ".toml", ".yaml", ".yml", ".html",
                 ".css", ".sh", ".tex", ".csv", ""}
MAX_FILE_BYTES = 2_000_000


def corpus_files(paths: Iterable[str | Path]) -> list[Path]:
    """Every text file named or found (recursively) under ``paths``, in a
    deterministic order.  Folders contribute files with common text
    suffixes (or none); hidden folders and ``__pycache__`` are skipped."""
    out: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.exists():
            raise ModelNotFoundError(f"corpus path {path} does not exist")
        if path.is_file():
            out.append(path)
            continue
        for f in sorted(path.rglob("*")):
            rel = f.relative_to(path).parts
            if any(part.startswith(".") or part == "__pycache__" for part in rel):
                continue
            if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES \
                    and f.stat().st_size <= MAX_FILE_BYTES:
                out.append(f)
    seen, unique = set(), []
    for f in out:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    if not unique:
        raise ConfigError(f"no text files found in the corpus {[str(p) for p in paths]}")
    return unique


def read_text(path: Path) -> str | None:
    """The file's text, or ``None`` where it is unreadable, binary or not UTF-8."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:4096]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None
