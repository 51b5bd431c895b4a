"""Where commands write: output folders that never clobber, files written atomically, names that stay inside.

Every command with ``--out`` follows one rule (:func:`prepare_dir`): the folder is created if missing; an existing
*file* there is an error; an existing folder that is not empty is an error unless ``--force`` is given — or it
is the command's own (a sweep's holds its resume marker ``results.jsonl``; a search's holds ``search.json`` naming
the same search): re-running there resumes. A command's default folder (no ``--out`` given) is never reused when
not empty and not its own: the run gets a fresh one beside it (or resumes in one of those that is). Files are written
to a temporary name in the same folder and renamed into place (:func:`write_text`, :func:`write_bytes`,
:func:`replacing`): a reader sees the old file or the new one, never half of one, and a kill leaves no torn
output. Nothing is written through a symbolic link. Names taken from specs (a sweep's ``name``) become one path
component (:func:`safe_name`), so ``x/../../escaped`` cannot leave the output root.

In ``topology`` (the bottom layer), so that the simulator and every command import it.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rackbed.topology.errors import UserError

_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def add_force(parser: argparse.ArgumentParser,
              help: str = "write into an existing, non-empty output folder (files of the same name are replaced)"
              ) -> None:
    """The ``--force`` flag of a command with ``--out``."""
    parser.add_argument("--force", action="store_true", help=help)


def safe_name(name: str) -> str:
    """``name`` as one harmless path component: runs of characters other than letters, digits and ``._+-`` become
    ``-``, leading dots and dashes go (no ``..``, no hidden file, no option-like name); empty -> ``unnamed``."""
    s = _UNSAFE.sub("-", str(name)).lstrip(".-")
    s = re.sub(r"\.{2,}", ".", s)
    return s or "unnamed"


def _no_link(path: Path, what: str) -> None:
    if path.is_symlink():
        raise UserError(f"{what} {path}: is a symbolic link; rackbed does not write through links")


def prepare_dir(path: str | Path, *, force: bool = False, resume_marker: str | None = None, flag: str = "--out",
                default: bool = False, own: Callable[[Path], bool] | None = None) -> Path:
    """Create output folder ``path`` (and its parents) or accept an existing one under the module's rule; returns
    the folder to write into. ``resume_marker``: a file whose presence makes a non-empty folder the command's own (it
    resumes there); ``own``: the test of that instead (given a folder, True when it is the command's own).
    ``default``: ``path`` is the command's default (the user gave no ``--out``): a non-empty folder there that is
    not the command's own is left alone and the first of ``path-2``, ``path-3`` … that is missing, empty or the
    command's own is used instead (the commands print it)."""
    p = Path(path)
    _no_link(p, flag)
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {p}: is a file, not a folder; give a folder to write into")

    def is_own(q: Path) -> bool:
        if own is not None:
            return own(q)
        return resume_marker is not None and (q / resume_marker).is_file()

    mine = p.is_dir() and is_own(p)
    if default and not force and not mine and p.is_dir() and any(p.iterdir()):
        n = 2
        while True:
            q = p.parent / f"{p.name}-{n}"
            if not q.exists() or (q.is_dir() and not q.is_symlink() and (not any(q.iterdir()) or is_own(q))):
                return prepare_dir(q, flag=flag, force=True)
            n += 1
    if p.is_dir() and not force and not mine and any(p.iterdir()):
        raise UserError(f"{flag} {p}: folder exists and is not empty; pass --force to write into it, or choose "
                        "another folder")
    p.mkdir(parents=True, exist_ok=True)
    return p


def prepare_file(path: str | Path, *, force: bool = False, flag: str = "--out") -> Path:
    """Check an output *file* ``path``: not a folder, not a link, and not existing unless ``force``; creates its
    folder. Returns it."""
    p = Path(path)
    _no_link(p, flag)
    if p.is_dir():
        raise UserError(f"{flag} {p}: is a folder; name the file to write")
    if p.exists() and not force:
        raise UserError(f"{flag} {p}: exists; pass --force to replace it, or choose another file")
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


@contextmanager
def replacing(path: str | Path, mode: str = "w") -> Iterator:
    """Open a temporary file beside ``path`` (``mode`` ``"w"`` or ``"wb"``); on a clean exit it is flushed to disk
    and renamed over ``path`` (a link at ``path`` is an error, not followed); on an error it is removed and
    ``path`` is left as it was."""
    p = Path(path)
    _no_link(p, "output")
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8", "newline": ""})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (:func:`replacing`). Returns the path."""
    with replacing(path, "w") as f:
        f.write(text)
    return Path(path)


def write_out_file(path: str | Path, text: str, *, force: bool = False, flag: str = "--out") -> Path:
    """A command's output file: :func:`prepare_file` then :func:`write_text`."""
    return write_text(prepare_file(path, force=force, flag=flag), text)


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (:func:`replacing`). Returns the path."""
    with replacing(path, "wb") as f:
        f.write(data)
    return Path(path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
