"""Every file the ``hdp`` command writes goes through here: the output path is checked before the work
starts (`check_output_file`, `check_output_dir`) and written atomically (`atomic_output`, `write_atomic`).

An output may be an existing regular file (replaced) or a new name in an existing folder this process
can write.  Anything else is a `CliError` naming the flag, the path and the fix: a directory given for a
file, a FIFO, a character or block device (``/dev/null``), a socket, a read-only file, a missing or
read-only folder, and any path on a kernel pseudo-filesystem (``/proc``, ``/sys``, ``/dev``: the mount
table says which).  Writing goes to a temporary file in the same folder, renamed over the target with
``os.replace`` only after the path was checked again, so a reader never sees half a file and a device,
FIFO or socket is never replaced.  A symbolic link is followed: its target is what is written.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from hdp.trainer.cli.common import CliError

__all__ = ["check_output_file", "check_output_dir", "atomic_output", "write_atomic", "PSEUDO_FILESYSTEMS"]

PSEUDO_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs",
    "pstore", "bpf", "mqueue", "fusectl", "efivarfs", "binfmt_misc", "autofs", "hugetlbfs", "nsfs", "rpc_pipefs",
})
"""Filesystem types whose files are kernel interfaces, never a place for a result."""

_FIX = "name a regular file, or a new file in a folder you can write"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def _mount_type(path: str) -> str | None:
    """The filesystem type of the mount holding the absolute ``path`` (``/proc/self/mounts``; None where
    there is no such table)."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as fh:
            table = fh.read(1 << 22)
    except OSError:
        return None
    best, fstype = -1, None
    for line in table.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[1])  # \040 is a space
        inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= best:  # the deepest mount; of mounts stacked on one point, the last
            best, fstype = len(mnt), parts[2]
    return fstype


def _check_place(where: str, real: str) -> None:
    fs = _mount_type(real)
    if fs in PSEUDO_FILESYSTEMS:
        raise CliError(f"{where}: {real!r} is on a {fs} filesystem (kernel interface files), not a place for "
                       f"output; {_FIX}")


def _checked_file(flag: str, value: str | os.PathLike[str]) -> tuple[Path, os.stat_result | None]:
    """(the file to write, its stat or None when new); CliError naming ``flag`` when it may not be written."""
    where = f"{flag}={os.fspath(value)!r}"
    if not os.fspath(value):
        raise CliError(f"{where}: empty path; {_FIX}")
    real = os.path.realpath(value)  # a link's target is what is written
    try:
        st: os.stat_result | None = os.stat(real)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise CliError(f"{where}: cannot be inspected ({exc.strerror}); {_FIX}") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise CliError(f"{where} is a directory; name a file in it")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise CliError(f"{where} is {_kind(st.st_mode)}, and it is never replaced; {_FIX}")
    _check_place(where, real)
    parent = os.path.dirname(real)
    if not os.path.isdir(parent):
        raise CliError(f"{where}: the folder {parent!r} does not exist; create it first, or {_FIX}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CliError(f"{where}: the folder {parent!r} is not writable by this user; {_FIX}")
    if st is not None and not os.access(real, os.W_OK):
        raise CliError(f"{where}: {real!r} is read-only; make it writable, or {_FIX}")
    return Path(real), st


def check_output_file(flag: str, value: str | os.PathLike[str], *, default_suffix: str | None = None,
                      suffixes: Sequence[str] | None = None) -> Path:
    """The output file ``value`` of ``flag``, checked before any work (CliError naming the flag, the path
    and the fix).  ``default_suffix`` (e.g. ``".png"``) is appended to a new name without one, and the result
    is the path that will be written and reported; ``suffixes`` are the ones allowed (lower case, dotted; a
    name without a suffix is allowed too)."""
    text, path = os.fspath(value), Path(value)
    if text.endswith(os.sep) or os.path.isdir(text):
        what = "is a directory" if os.path.isdir(text) else "names a folder (it ends with a slash)"
        example = os.path.join(text, "out" + (default_suffix or (suffixes[0] if suffixes else ".json")))
        raise CliError(f"{flag}={text!r} {what}; name a file in it (e.g. {example!r})")
    if default_suffix is not None and path.name and not path.suffix and not os.path.lexists(text):
        path = path.with_name(path.name + default_suffix)  # a new name without a suffix; an existing one as given
    if suffixes is not None and path.suffix and path.suffix.lower() not in suffixes:
        raise CliError(f"{flag}={text!r}: {path.suffix} is not one of {', '.join(suffixes)}; name the file with one "
                       f"of them (e.g. {path.stem}{suffixes[0]})")
    _checked_file(flag, path)
    return path


def check_output_dir(flag: str, value: str | os.PathLike[str]) -> Path:
    """The output folder ``value`` of ``flag``: an existing folder this process can write, or a new one
    whose nearest existing ancestor is (it is created when written to).  CliError otherwise."""
    where = f"{flag}={os.fspath(value)!r}"
    if not os.fspath(value):
        raise CliError(f"{where}: empty path; name a folder")
    real = os.path.realpath(value)
    probe = real
    while not os.path.lexists(probe):  # the nearest existing ancestor
        probe = os.path.dirname(probe)
    try:
        st = os.stat(probe)
    except OSError as exc:
        raise CliError(f"{where}: {probe!r} cannot be inspected ({exc.strerror}); name a folder you can write") from None
    if not stat.S_ISDIR(st.st_mode):
        what = "is a file" if stat.S_ISREG(st.st_mode) else f"is {_kind(st.st_mode)}"
        named = "" if probe == real else f": {probe!r} {what}"
        raise CliError(f"{where}{named if named else ' ' + what}; name a folder (it is created when missing)")
    _check_place(where, real)
    if not os.access(probe, os.W_OK | os.X_OK):
        raise CliError(f"{where}: the folder {probe!r} is not writable by this user; name a folder you can write")
    return Path(value)


@contextmanager
def atomic_output(path: str | os.PathLike[str], flag: str = "output") -> Iterator[Path]:
    """Yield a temporary file beside ``path`` to write; on success it replaces ``path`` (checked again just
    before, so a device, FIFO or socket that appeared meanwhile is refused, not replaced); on error it is
    removed and ``path`` is left as it was."""
    real, _ = _checked_file(flag, path)
    fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        real, st = _checked_file(flag, path)
        if st is not None:
            mode = stat.S_IMODE(st.st_mode)
        else:
            umask = os.umask(0o022)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)  # mkstemp's 0600 would hide a new result from the group
        os.replace(tmp, real)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_atomic(path: str | os.PathLike[str], data: str | bytes, flag: str = "output") -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` through `atomic_output`; returns ``path``."""
    with atomic_output(path, flag) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)
