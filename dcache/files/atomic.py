"""Atomic file writes for everything dcache writes (plans, stats, calibrations, search fronts, reports, images).

    atomic_write_text(path, text)            # str
    atomic_write_bytes(path, data)           # bytes
    atomic_write_with(path, lambda tmp: fig.savefig(tmp))   # a writer that takes a file path (matplotlib, PIL)

Each writes a temporary file in the destination folder and renames it over `path` (`os.replace`, atomic on POSIX
and Windows), so a reader sees the old file or the new one, never half of one; a failure (or Ctrl-C) anywhere
removes the temporary file and leaves the old file untouched.

Permissions: the temporary file is created with `os.open(..., 0o666)`, so the kernel applies the process umask,
exactly as for `open(path, "w")` on a new file: 0644 under the usual umask 022 (`tempfile.mkstemp` would create
0600, unreadable for the people an output folder is shared with). The temporary name keeps the destination's
suffix, so writers that pick a format from the suffix (matplotlib, PIL) write the right one.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, Callable

NEW_FILE_MODE = 0o666  # minus the umask, as open(path, "w") creates files


def _create_temporary(path: Path) -> tuple[Path, int]:
    """A fresh name beside `path`, created with the umask applied (O_EXCL: never someone else's file); its fd."""
    for _ in range(100):
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp{path.suffix}")
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                                NEW_FILE_MODE)
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary file beside {path}")


def _atomic(path: str | os.PathLike, fill: Callable[[Path, int], object]) -> Path:
    """fill(tmp, fd) writes the temporary file (and closes fd); then fsync and rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, fd = _create_temporary(path)
    try:
        fill(tmp, fd)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_with(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call write(tmp) to fill a temporary file beside `path` (it keeps the suffix), then rename it over `path`."""

    def fill(tmp: Path, fd: int) -> None:
        os.close(fd)
        write(tmp)

    return _atomic(path, fill)


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    def fill(tmp: Path, fd: int) -> None:
        with os.fdopen(fd, "w", encoding=encoding) as f:
            f.write(text)

    return _atomic(path, fill)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    def fill(tmp: Path, fd: int) -> None:
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    return _atomic(path, fill)


# The temporary names _create_temporary gives: .<stem>.<pid>.<8 hex>.tmp<suffix>
TEMPORARY_NAME = re.compile(r"^\..*\.(\d+)\.[0-9a-f]{8}\.tmp(\.[^./]*)?$")


def remove_stale_temporaries(folder: str | os.PathLike, *, recursive: bool = False) -> list[Path]:
    """Delete the temporary files that a killed dcache process (kill -9, power loss) left in `folder`: names of
    _create_temporary's pattern whose writer process is gone. A live writer's file (its pid exists on this machine)
    is kept. Returns the removed paths; resumes call this on the folders they write to."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for path in folder.rglob(".*.tmp*") if recursive else folder.glob(".*.tmp*"):
        match = TEMPORARY_NAME.match(path.name)
        if match is None or path.is_symlink() or not path.is_file() or _alive(int(match.group(1))):
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # another user's process (or an unusual pid): not ours to judge, keep its file
    return True


def read_limited(path: str | os.PathLike, limit: int, what: str, fix: str,
                 error: type[Exception] = ValueError) -> bytes:
    """The bytes of the file `path`, refused before reading when it is larger than `limit` bytes (os.stat first:
    a 2 GB file costs one system call, not 2 GB of memory). `what` names the kind of file in the messages, `fix`
    says what to do; errors are `error(message)`."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size <= limit:
            with open(path, "rb") as f:
                data = f.read(limit + 1)  # a file that grew since stat() is cut at the limit + 1 and refused
            size = max(size, len(data))
    except OSError as exc:
        raise error(f"cannot read the {what} {str(path)!r} ({exc.strerror or exc}); {fix}.") from None
    if size > limit:
        raise error(f"the {what} {str(path)!r} has {size:,} bytes, more than the {limit:,} dcache reads for one "
                    f"(no {what} it writes is that large: the file is another program's or damaged); {fix}.")
    return data


def read_json(path: str | os.PathLike, limit: int, what: str, fix: str, error: type[Exception] = ValueError) -> Any:
    """The JSON value in the file `path` (at most `limit` bytes, see read_limited); invalid UTF-8 or JSON, integers
    too long to convert and nesting too deep to parse are `error` naming the file and `fix`."""
    raw = read_limited(path, limit, what, fix, error)
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int digits limit: ValueErrors
        detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:160]
        raise error(f"the {what} {str(path)!r} is not valid JSON ({detail}); it is corrupted or truncated, "
                    f"{fix}.") from None


def check_inside(root: str | os.PathLike, path: str | os.PathLike, what: str, fix: str,
                 error: type[Exception] = ValueError) -> Path:
    """`path` resolved (symbolic links followed), refused unless it lies inside `root` (resolved too): a `..`
    component, an absolute path or a link that leaves the output folder is `error` naming it and `fix`."""
    base = Path(root).resolve()
    full = (Path(root) / path).resolve()
    if full != base and base not in full.parents:
        raise error(f"{what} {str(Path(root) / path)!r} leads out of {str(base)!r} (to {str(full)!r}): dcache "
                    f"reads and writes only inside its output folder; {fix}.")
    return full


# Suffixes of the files dcache and its users write: an output folder that does not exist yet and is named like
# one (`--out cat.png`) is a file name given where a folder is meant, refused instead of becoming a folder `cat.png/`.
FILE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".mp4", ".webm",
                           ".avi", ".mov", ".json", ".md", ".txt", ".csv", ".html", ".safetensors", ".pt", ".pth"})


class OutputDirError(ValueError):
    """An output folder that cannot be used; the message names it and the fix."""


def prepare_out_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Create the output folder `path` (and its parents) or check the existing one, before any work starts: a path
    that is a file, sits under a file, or is not writable is an OutputDirError naming it and the fix."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputDirError(f"{flag} {str(path)!r} is a file, not a folder; pass a folder path (it is created if "
                             f"missing).")
    if not path.exists() and path.suffix.lower() in FILE_SUFFIXES:
        raise OutputDirError(f"{flag} {str(path)!r} names a {path.suffix} file, but {flag} is the folder the "
                             f"results are written into (grid.png, stats.json, ...); pass a folder path, e.g. "
                             f"{str(path.with_suffix(''))!r}.")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise OutputDirError(f"{flag} {str(path)!r} cannot be created: a part of that path is a file; pass a folder "
                             f"path.") from None
    except OSError as exc:
        raise OutputDirError(f"{flag} {str(path)!r} cannot be created ({exc.strerror or exc}); pass a folder you can "
                             f"write to.") from None
    try:  # a real write: permission bits, read-only mounts and root all answer the same way
        tmp, fd = _create_temporary(path / ".dcache-write-check")
        os.close(fd)
        tmp.unlink()
    except OSError as exc:
        raise OutputDirError(f"{flag} {str(path)!r} is not writable ({exc.strerror or exc}); pass a folder you can "
                             f"write to.") from None
    return path


__all__ = ["atomic_write_text", "atomic_write_bytes", "atomic_write_with", "prepare_out_dir", "OutputDirError",
           "read_limited", "read_json", "check_inside", "remove_stale_temporaries"]
