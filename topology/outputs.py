"""Where rackbed writes: one rule for every file it writes (every command, the torchrun entry, side outputs,
benchmarks).

* **Output folders** (:func:`prepare_dir`): created if missing; an existing *file* there is an error; an
  existing folder that is not empty is an error unless ``--force`` is given — or it is the command's own (a
  sweep's holds its resume marker ``results.jsonl``; a search's holds ``search.json`` naming the same search):
  re-running there resumes. A command's default folder (no ``--out`` given) is never reused when not empty and
  not its own: the run gets a fresh one beside it (``NAME-2``, ``NAME-3`` …, or resumes in one of those that
  is its own).
* **Output files** (:func:`prepare_file`): not a folder, and an existing file is replaced only with
  ``--force``.
* **One run per folder**: a process claims its output folder before writing — a missing folder by creating it
  (``mkdir``, which only one process can win) and every folder by an exclusive, non-blocking lock on it
  (``flock``) held until the command ends (:func:`release_claims`). A folder another rackbed process holds is
  skipped (a default folder: the next suffix) or refused (an ``--out`` folder), so two runs started together
  never share a folder, not even when resuming.
* **No links**: nothing is written through a symbolic link — not an output folder that is a link, not an
  output file that is a link, not a link inside an output folder (files are replaced by rename, appends open
  with ``O_NOFOLLOW``). A link *above* the path given (a parent folder) is the user's layout and is followed.
* **Shipped data stays as shipped**: nothing is written inside rackbed's data folders (``calibration/``,
  ``scenarios/``, ``engine/core/data/``; :func:`shipped_roots`) — except one file named explicitly by a
  command's file flag (``--out``, ``--measurements-out``, ``--write-engine-calibration``) together with
  ``--force``: that is how a maintainer regenerates a shipped calibration. Output folders, default paths and
  names derived from other paths are never inside shipped data.
* **Atomic files**: files are written to a temporary name in the same folder and renamed into place
  (:func:`write_text`, :func:`write_bytes`, :func:`replacing`): a reader sees the old file or the new one,
  never half of one, and a kill leaves no torn output.
* **Names stay inside**: names taken from specs (a sweep's ``name``) become one path component
  (:func:`safe_name`), so ``x/../../escaped`` cannot leave the output root.

A broken rule is a :class:`~rackbed.topology.errors.UserError` naming the path and the rule (one line, exit
2). ``tests/test_output_rule.py`` walks every command that writes; it also fails on a raw write (``open(…,
"w")``, ``write_text`` of a path, ``savefig(path)`` …) in the commands, the simulator, the real engine and the
benchmarks outside these helpers.

In ``topology`` (the bottom layer), so that the simulator and every command import it.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from rackbed.topology.errors import UserError

_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")
#: rackbed's shipped data packages (``rackbed.shipped`` arguments); nothing is written inside them but a file
#: named explicitly with --force
SHIPPED_DATA = (("calibration",), ("scenarios",), ("engine.core", "data"))


def add_force(parser: argparse.ArgumentParser,
              help: str = "write into an existing, non-empty output folder (files of the same name are "
                          "replaced)") -> None:
    """The ``--force`` flag of a command with ``--out``."""
    parser.add_argument("--force", action="store_true", help=help)


def safe_name(name: str) -> str:
    """``name`` as one harmless path component: runs of characters other than letters, digits and ``._+-``
    become ``-``, leading dots and dashes go (no ``..``, no hidden file, no option-like name); empty ->
    ``unnamed``."""
    s = _UNSAFE.sub("-", str(name)).lstrip(".-")
    s = re.sub(r"\.{2,}", ".", s)
    return s or "unnamed"


def _no_link(path: Path, what: str) -> None:
    if path.is_symlink():
        raise UserError(f"{what} {path}: is a symbolic link; rackbed does not write through links")


@functools.lru_cache(maxsize=1)
def shipped_roots() -> tuple[Path, ...]:
    """The resolved folders of rackbed's shipped data (:data:`SHIPPED_DATA`)."""
    from rackbed import shipped

    return tuple(shipped(*parts) for parts in SHIPPED_DATA)


def shipped_root_of(path: str | Path) -> Path | None:
    """The shipped data folder that ``path`` (resolved: links above it followed) lies in, else None."""
    p = Path(path).resolve()
    for root in shipped_roots():
        if p == root or root in p.parents:
            return root
    return None


def _not_shipped_dir(p: Path, flag: str) -> None:
    root = shipped_root_of(p)
    if root is not None:
        raise UserError(f"{flag} {p}: is inside rackbed's shipped data ({root}); write output folders "
                        "elsewhere")


def _shipped_file_ok(p: Path, flag: str, force: bool, default: bool) -> None:
    root = shipped_root_of(p)
    if root is None or (force and not default):
        return
    how = ("name it with a file flag and --force to regenerate shipped data" if default else
           "pass --force to regenerate shipped data, or choose another file")
    raise UserError(f"{flag} {p}: is inside rackbed's shipped data ({root}); {how}")


# ------------------------------------------------------------------------------------------------------------
# Claims: one process (one thread) per output folder

_claims: dict[tuple[int, int], tuple[int, int]] = {}  # (st_dev, st_ino) of a claimed folder -> (fd, thread)
_claims_lock = threading.Lock()


def _claim(p: Path) -> bool:
    """Lock folder ``p`` for this process and thread until :func:`release_claims`; False when another rackbed
    process (or another thread of this one) holds it. True without a lock where the platform or file system
    has none."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no locks
        return True
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UserError(f"output folder {p}: cannot open it ({exc.strerror})") from None
    st = os.fstat(fd)
    key, me = (st.st_dev, st.st_ino), threading.get_ident()
    with _claims_lock:
        held = _claims.get(key)
        if held is not None:
            os.close(fd)
            return held[1] == me
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except OSError:  # a file system without locks
            pass
        _claims[key] = (fd, me)
    return True


def release_claims() -> None:
    """Release the folders this thread claimed (the CLI calls it when a command ends; a process's claims end
    with it anyway)."""
    me = threading.get_ident()
    with _claims_lock:
        for key, (fd, who) in list(_claims.items()):
            if who == me:
                del _claims[key]
                os.close(fd)


class _Skip(Exception):
    """A default folder candidate that cannot be used (the next suffix is tried)."""


def _take(q: Path, *, force: bool, is_own: Callable[[Path], bool], flag: str, skip: bool) -> Path:
    """Claim folder ``q`` under the module's rule; raises UserError, or _Skip where ``skip`` (a default
    folder's candidate) and the problem is that it is taken."""
    def refuse(msg: str) -> None:
        if skip:
            raise _Skip
        raise UserError(f"{flag} {q}: {msg}")

    if q.is_symlink():
        refuse("is a symbolic link; rackbed does not write through links")
    if q.exists() and not q.is_dir():
        refuse("is a file, not a folder; give a folder to write into")
    _not_shipped_dir(q, flag)
    q.parent.mkdir(parents=True, exist_ok=True)
    try:
        q.mkdir()  # the claim of a new folder: one process creates it
        created = True
    except FileExistsError:
        created = False
        if q.is_symlink() or not q.is_dir():  # replaced meanwhile
            return _take(q, force=force, is_own=is_own, flag=flag, skip=skip)
    if not _claim(q):
        refuse("another rackbed process is writing there; wait for it, or choose another folder")
    if not created and not force and any(q.iterdir()) and not is_own(q):
        _release_one(q)
        refuse("folder exists and is not empty; pass --force to write into it, or choose another folder")
    return q


def _release_one(q: Path) -> None:
    st = os.stat(q, follow_symlinks=False)
    with _claims_lock:
        held = _claims.pop((st.st_dev, st.st_ino), None)
    if held is not None:
        os.close(held[0])


def prepare_dir(path: str | Path, *, force: bool = False, resume_marker: str | None = None,
                flag: str = "--out", default: bool = False,
                own: Callable[[Path], bool] | None = None) -> Path:
    """Claim output folder ``path`` (created with its parents) or an existing one under the module's rule;
    returns the folder to write into. ``resume_marker``: a file whose presence makes a non-empty folder the
    command's own (it resumes there); ``own``: the test of that instead (given a folder, True when it is the
    command's own). ``default``: ``path`` is the command's default (the user gave no ``--out``): a folder
    there that is not empty and not the command's own, or that another process holds, is left alone and the
    first of ``path-2``, ``path-3`` … that can be claimed (missing, empty or the command's own) is used
    instead (the commands print it)."""
    p = Path(path)

    def is_own(q: Path) -> bool:
        if own is not None:
            return own(q)
        return resume_marker is not None and (q / resume_marker).is_file()

    _no_link(p, flag)
    if not default:
        return _take(p, force=force, is_own=is_own, flag=flag, skip=False)
    n = 1
    while True:
        q = p if n == 1 else p.parent / f"{p.name}-{n}"
        try:
            # an explicit --force applies to the default folder itself, not to the fresh ones beside it
            return _take(q, force=force and n == 1, is_own=is_own, flag=flag, skip=n > 1 or not q.is_file())
        except _Skip:
            n += 1


def prepare_file(path: str | Path, *, force: bool = False, flag: str = "--out",
                 default: bool = False) -> Path:
    """Check an output *file* ``path``: not a folder, not a link, not existing unless ``force``, and not
    inside shipped data unless named explicitly (``default`` False: the user gave this path) with
    ``force``; creates its folder. ``default``: the path is a command's default or derived from another
    path. Returns it."""
    p = Path(path)
    _no_link(p, flag)
    if p.is_dir():
        raise UserError(f"{flag} {p}: is a folder; name the file to write")
    _shipped_file_ok(p, flag, force, default)
    if p.exists() and not force:
        raise UserError(f"{flag} {p}: exists; pass --force to replace it, or choose another file")
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def entry_file(path: str | Path, *, force: bool = False, flag: str = "--out", default: bool = False) -> Path:
    """:func:`prepare_file` for a script entry point (``python -m rackbed.kernels.bench.probe --out F``): a
    broken rule prints one line and exits with status 2, as the CLI does."""
    return _entry(prepare_file, path, force=force, flag=flag, default=default)


def entry_dir(path: str | Path, **kw) -> Path:
    """:func:`prepare_dir` for a script entry point (see :func:`entry_file`)."""
    return _entry(prepare_dir, path, **kw)


def _entry(fn: Callable[..., Path], *args, **kw) -> Path:
    try:
        return fn(*args, **kw)
    except UserError as exc:
        print(f"rackbed: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def open_append(path: str | Path) -> IO[str]:
    """``path`` opened for appending text (created if missing), never through a link (``O_NOFOLLOW``)."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError:
        if p.is_symlink():
            raise UserError(f"output {p}: is a symbolic link; rackbed does not write through links") from None
        raise
    return os.fdopen(fd, "a", encoding="utf-8")


@contextmanager
def replacing(path: str | Path, mode: str = "w") -> Iterator:
    """Open a temporary file beside ``path`` (``mode`` ``"w"`` or ``"wb"``); on a clean exit it is flushed to
    disk and renamed over ``path`` (a link at ``path`` is an error, not followed); on an error it is removed
    and ``path`` is left as it was."""
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
    """Write ``text`` to ``path`` atomically (:func:`replacing`); a ``.gz`` path gets it gzip-compressed (no
    timestamp inside, so the same text gives the same bytes). Returns the path."""
    if Path(path).name.lower().endswith(".gz"):
        import gzip

        return write_bytes(path, gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0))
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
