"""The training text: CPython's standard-library sources, split by file into train and held-out.

The split is a hash of the file's path relative to the stdlib, so it is the same on every machine
with the same Python, and a held-out file can never leak into training.
"""

import hashlib
import sysconfig
from pathlib import Path

EOT = "<|endoftext|>"
HELD_OUT_ONE_IN = 20  # about 5% of files are held out
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relpath: str) -> bool:
    digest = hashlib.sha1(relpath.encode()).digest()
    return int.from_bytes(digest[:4], "big") % HELD_OUT_ONE_IN == 0


def source_files() -> list[str]:
    """Relative paths of the stdlib's .py files, tests and third-party packages excluded."""
    root = stdlib_root()
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        paths.append(rel.as_posix())
    return sorted(paths)


def read_source(relpath: str) -> str:
    return (stdlib_root() / relpath).read_text(encoding="utf-8", errors="replace")


def split_files() -> tuple[list[str], list[str]]:
    files = source_files()
    train = [f for f in files if not is_held_out(f)]
    held_out = [f for f in files if is_held_out(f)]
    return train, held_out
