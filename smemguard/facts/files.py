"""Files smemguard reads or replaces that others may have written: the one home of opening them safely,
replacing them atomically under a lock, and moving a bad one aside.

* Only regular files are opened, and never with a blocking ``open``: a FIFO with no writer (or
  no reader) would hang the command or the serving process forever, and a device such as
  ``/dev/zero`` never ends. Every open is ``O_NONBLOCK``, then ``fstat`` decides.
* Reads are bounded (:func:`read_bytes` takes a limit): a file larger than its kind can be is
  refused, not read into memory.
* A trusted file (the decision cache, :func:`check_trusted`) is refused when another user can
  write it or the directory holding it, as ssh refuses a writable ``authorized_keys``: whoever can
  write it decides what every worker of the host compiles.
* :func:`replace` writes a temporary file beside the target and renames it over, so a reader never
  sees half a file; :func:`exclusive` is the host-wide ``flock`` writers take around
  read-change-replace; :func:`move_aside` keeps a corrupt file under a new name (nothing is lost).

Every failure is an :class:`OSError` (:class:`Refused` for the refusals) whose ``str`` is one line
for the user.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Iterator

#: What a path is, for the refusal line (``stat.S_IFMT`` -> words).
_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


class Refused(OSError):
    """A path smemguard will not use: not a regular file, too large, or writable by others."""

    def __str__(self) -> str:
        return self.strerror


class Untrusted(Refused):
    """A file or directory that decides what runs, and that another user can write."""


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


#: Added to the flags of an open that must not go through a symbolic link named as the file.
_NO_LINK = getattr(os, "O_NOFOLLOW", 0)


def _opened(path: Path, flags: int, mode: int = 0o644) -> int:
    """A descriptor of ``path`` opened without blocking; Refused unless it is a regular file (and, with
    :data:`_NO_LINK` in ``flags``, unless ``path`` itself is one, not a symbolic link)."""
    try:
        descriptor = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0), mode)
    except OSError as error:
        if error.errno == errno.ENXIO:  # a FIFO opened for writing with no reader
            raise Refused(errno.EINVAL, f"{path} is a FIFO (named pipe), not a regular file") from None
        if error.errno == errno.ELOOP and flags & _NO_LINK:
            raise Refused(errno.ELOOP, f"{path} is a symbolic link; smemguard opens only the file it names, never "
                                       "one a link points to") from None
        raise
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise Refused(errno.EINVAL, f"{path} is {_kind(status.st_mode)}, not a regular file")
        os.set_blocking(descriptor, True)
        return descriptor
    except BaseException:
        os.close(descriptor)
        raise


def open_read(path: Path, follow_links: bool = True):
    """``path`` opened for reading in binary, regular files only (OSError, Refused otherwise); without
    ``follow_links``, a symbolic link named as the file is Refused, its target never read."""
    return os.fdopen(_opened(path, os.O_RDONLY | (0 if follow_links else _NO_LINK)), "rb")


def append_line(path: Path, line: str) -> None:
    """Append ``line`` (one record) and a newline to ``path`` (created when missing) in one write, so that writers
    of other processes never interleave with it. Regular files only, never through a symbolic link: a link named
    as the file would make smemguard append to (or create) a file the user did not name.

    The line starts a line of its own even after a fragment another writer left (killed mid-write, or out of
    space); a write cut short (a full disk) is taken back where no other writer appended after it, and raises:
    the next record, of any process, is never glued to a fragment."""
    appending = os.O_APPEND | os.O_CREAT | _NO_LINK
    try:
        descriptor, readable = _opened(path, os.O_RDWR | appending), True
    except PermissionError:  # a file this user may write but not read: appended without looking at its end
        descriptor, readable = _opened(path, os.O_WRONLY | appending), False
    try:
        size = os.fstat(descriptor).st_size
        after_fragment = readable and size and os.pread(descriptor, 1, size - 1) != b"\n"
        data = (b"\n" if after_fragment else b"") + line.encode() + b"\n"
        written = os.write(descriptor, data)
        if written < len(data):
            end = os.lseek(descriptor, 0, os.SEEK_CUR)  # O_APPEND: where this write ended
            if os.fstat(descriptor).st_size == end:
                os.ftruncate(descriptor, end - written)
            raise OSError(errno.ENOSPC, f"only {written} of {len(data)} bytes could be written (a full disk or a "
                                        "file size limit); the part written was taken back")
    finally:
        os.close(descriptor)


def read_bytes(path: Path, limit: int, follow_links: bool = True) -> bytes:
    """The contents of regular file ``path``; Refused when it holds more than ``limit`` bytes (or, without
    ``follow_links``, when it is a symbolic link)."""
    with open_read(path, follow_links) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise Refused(errno.EFBIG, f"{path} is larger than {_size(limit)}, more than such a file can hold")
    return data


def _size(count: int) -> str:
    return f"{count // 2**20} MiB" if count >= 2**20 else f"{count // 2**10} KiB"


def _trust_problem(path: Path) -> str | None:
    try:
        status = os.stat(path)
    except OSError:  # missing: created by us; unreadable: the open says why
        return None
    if status.st_uid not in (os.getuid(), 0):
        return f"{path} belongs to another user (uid {status.st_uid}); fix: {_fix_for_foreign(path, status)}"
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{path} can be written by {'others' if status.st_mode & stat.S_IWOTH else 'its group'} "
                f"(mode {stat.S_IMODE(status.st_mode):o}); fix: chmod go-w {path}")
    return None


def _fix_for_foreign(path: Path, status: os.stat_result) -> str:
    """A file of another user's in a directory of one's own is moved away; a directory of another user's is left."""
    try:
        own_directory = not stat.S_ISDIR(status.st_mode) and os.stat(path.parent).st_uid == os.getuid()
    except OSError:
        own_directory = False
    return (f"move it away (smemguard starts a new one), or chown it to uid {os.getuid()}" if own_directory else
            "use a directory of your own")


def check_trusted(*paths: Path) -> None:
    """Untrusted when one of ``paths`` (files or directories that decide what runs) is owned by
    another user, or can be written by its group or others; a missing path is no problem."""
    for path in paths:
        problem = _trust_problem(path)
        if problem is not None:
            raise Untrusted(errno.EPERM, problem)


def make_directory(path: Path) -> None:
    """Create ``path`` and each missing parent for smemguard's own files, readable by their owner only (``mkdir``'s
    ``parents=True`` would give the parents the umask's mode, mostly 755)."""
    if not path.parent.is_dir() and path.parent != path:
        make_directory(path.parent)
    path.mkdir(mode=0o700, exist_ok=True)


#: The longest smemguard waits for a host-wide lock another process holds.
LOCK_WAIT_S = 10.0
#: After a wait for a lock ran out, that lock is only tried (never waited on) for a pause of :data:`LOCK_WAIT_S`,
#: doubled at each wait that runs out, up to this: a process meeting a lock held for ever waits 10 s at most every
#: 10 minutes, and takes the lock at its first try once it is free.
LOCK_PAUSE_MAX_S = 600.0
_paused: dict[Path, tuple[float, float]] = {}  # lock -> (when it may be waited on again, the next pause)


class Busy(Refused):
    """A host-wide lock another process has held for over :data:`LOCK_WAIT_S` (or held a moment ago, and still does)."""


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Hold the host-wide exclusive lock ``lock_path`` (created when missing) for the block. Writers hold it for
    milliseconds; one held for over :data:`LOCK_WAIT_S` (a stopped process, a hand-held ``flock``) is Busy, so
    that no command and no serving process ever waits on it for ever (nor for long again: :data:`LOCK_PAUSE_MAX_S`)."""
    # Never through a link: opening one named as the lock would create its target (as root: a file anywhere).
    descriptor = _opened(lock_path, os.O_WRONLY | os.O_CREAT | _NO_LINK, 0o600)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        resume, pause = _paused.get(lock_path, (0.0, LOCK_WAIT_S))
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now >= deadline or now < resume:
                    if now >= resume:
                        _paused[lock_path] = (now + pause, min(2 * pause, LOCK_PAUSE_MAX_S))
                    raise Busy(errno.ETIMEDOUT, f"{lock_path} has been held by another process for over "
                                                f"{LOCK_WAIT_S:g} s") from None
                time.sleep(0.01)
        _paused.pop(lock_path, None)
        yield
    finally:
        os.close(descriptor)  # closing releases the lock


def replace(path: Path, text: str, mode: int = 0o600) -> os.stat_result:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``; return its stat."""
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as out:
            out.write(text)
            os.fchmod(out.fileno(), mode)
            status = os.fstat(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return status


def move_aside(path: Path) -> Path:
    """Keep ``path`` as it is under a new name beside it (``<name>.bad-<time>-<pid>``); return that name."""
    aside = path.with_name(f"{path.name}.bad-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    os.replace(path, aside)
    return aside
