"""Checkpoints that cannot be half-written or half-loaded: slots, a manifest, checksums, one atomic commit.

A checkpoint directory ``path`` holds two data *slots* and a manifest::

    path/
      manifest.json      <- the commit record: which slot is complete, its files and their sha256
      slot-0/            <- one complete checkpoint (Megatron dist files or rank_*.pt)
      slot-1/            <- the other slot: the next save writes here

**Save** (collective over the checkpoint group; every step agreed by :class:`hdp.guard.StepGuard`):
the slot the manifest does not name is emptied and written by every rank; every rank flushes
(``fsync``) what it wrote; the files are hashed (each rank a share of them) and gathered; domain
rank 0 writes the manifest to a temporary file, ``fsync``\\ s it and ``os.replace``\\ s it into place —
the one atomic step that makes the new slot the checkpoint.  A process killed at any point before
that leaves the previous manifest and the previous slot untouched, so the previous checkpoint stays
loadable; a killed save leaves a partial slot that the next load names and the next save empties.

**Load** first verifies, on every rank and before anything is touched: the manifest (format
version, the caller's expectations such as the layout) and every file's sha256 (each rank hashes a
share, then one agreement).  Then :func:`check_fit` — the one rule every load goes through, both
doors (``HdpEngine.load_checkpoint`` and the verl engine's) and every format — compares what the
checkpoint holds with what this engine would load, from metadata only (no tensor is read): every
key, shape and dtype, and the identity both sides record (model-config digest, role, architecture);
any difference on any rank raises on every rank, naming the first differing tensor and both sides,
before the first write.  Only then does the caller read and apply the state.

Writer processes: megatron-core's torch_dist writer forks worker processes that would outlive a
killed rank (orphans writing shards, holding its stdout).  :func:`writers_die_with_parent` makes every
process forked while it is active receive SIGKILL when its parent dies (Linux ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import shutil
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from hdp.guard import StepGuard, describe
from hdp.procs import die_with_parent

__all__ = [
    "MANIFEST",
    "MANIFEST_VERSION",
    "Manifest",
    "CheckpointError",
    "read_manifest",
    "save_slots",
    "verify_checkpoint",
    "writers_die_with_parent",
    "file_digest",
    "TensorSpec",
    "StateView",
    "fit_problem",
    "merge_views",
    "check_fit",
    "state_tensors",
    "torch_file_tensors",
    "safetensors_tensors",
    "dist_checkpoint_tensors",
    "sharded_state_tensors",
]

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
"""File name of the commit record inside a checkpoint directory."""
MANIFEST_VERSION = 1
"""Layout version written by this hdp; another version is rejected on load."""
_SLOTS = ("slot-0", "slot-1")
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (missing, partial, corrupted, or for another model/layout)."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """The commit record of a checkpoint directory (``manifest.json``)."""

    version: int
    """Layout version (:data:`MANIFEST_VERSION`)."""
    format: str
    """How the slot's state is stored: ``dist`` (Megatron distributed checkpointing) or ``per-rank``."""
    slot: str
    """The complete data slot (``slot-0`` or ``slot-1``)."""
    step: int
    """Step counter of the saved engine."""
    meta: dict[str, Any]
    """What the state belongs to: model-config digest, world and domain size, parallel layout, ..."""
    files: dict[str, dict[str, Any]]
    """Path inside the slot -> ``{"sha256": hex, "bytes": size}`` for every file of the slot."""

    def to_json(self) -> str:
        """The manifest as JSON text."""
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"


def file_digest(path: Path) -> dict[str, Any]:
    """``{"sha256": hex, "bytes": size}`` of one file (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as fh:
        while True:
            block = fh.read(_CHUNK)
            if not block:
                break
            h.update(block)
            size += len(block)
    return {"sha256": h.hexdigest(), "bytes": size}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _listing(slot_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(slot_dir)) for p in slot_dir.rglob("*") if p.is_file())


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest of checkpoint directory ``path``; :class:`CheckpointError` naming what is wrong."""
    root = Path(path)
    mf = root / MANIFEST
    if not mf.is_file():
        partial = [s for s in _SLOTS if (root / s).exists()]
        if not root.exists():
            why = "does not exist"
        elif partial:
            why = (f"holds no {MANIFEST} but partial slot(s) {partial}: a save was interrupted before it "
                   "committed, so there is no complete checkpoint here")
        else:
            why = f"holds no {MANIFEST}"
        raise CheckpointError(f"checkpoint {str(root)!r} {why}; pass a directory written by HdpEngine.save_checkpoint")
    try:
        raw = json.loads(mf.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {str(root)!r}: {MANIFEST} is unreadable ({exc})") from exc
    if not isinstance(raw, dict) or raw.get("version") != MANIFEST_VERSION:
        got = raw.get("version") if isinstance(raw, dict) else None
        raise CheckpointError(
            f"checkpoint {str(root)!r}: {MANIFEST} version={got!r}, this hdp reads version {MANIFEST_VERSION}"
        )
    try:
        m = Manifest(**raw)
    except TypeError as exc:
        raise CheckpointError(f"checkpoint {str(root)!r}: {MANIFEST} lacks or has unknown fields ({exc})") from exc
    if m.slot not in _SLOTS or not isinstance(m.files, dict) or not m.files:
        raise CheckpointError(f"checkpoint {str(root)!r}: {MANIFEST} names slot {m.slot!r} with {len(m.files or {})} files")
    return m


def _share(items: list[str], rank: int, size: int) -> list[str]:
    return items[rank::size]


@dataclass(eq=False)
class _Writers:
    """Process state for :func:`writers_die_with_parent` (one instance per process)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    active: int = 0
    registered: bool = False


_WRITERS = _Writers()


def _child_dies_with_parent() -> None:  # runs in the forked child
    if _WRITERS.active > 0:
        die_with_parent()


@contextlib.contextmanager
def writers_die_with_parent() -> Iterator[None]:
    """While active, every process this process forks is SIGKILLed when this process dies (Linux).

    Spawned helpers (a fresh interpreter) are not covered by the fork hook: start them with
    :func:`hdp.procs.die_with_parent` as their initializer (see
    ``hdp.megatron_compat.checkpoint_writers_die_with_parent`` for Megatron's writer queue).
    """
    with _WRITERS.lock:
        if not _WRITERS.registered:
            os.register_at_fork(after_in_child=_child_dies_with_parent)
            _WRITERS.registered = True
        _WRITERS.active += 1
    try:
        yield
    finally:
        with _WRITERS.lock:
            _WRITERS.active -= 1


def save_slots(
    path: str | os.PathLike[str],
    *,
    guard: StepGuard,
    group: dist.ProcessGroup,
    rank: int,
    size: int,
    step: int,
    format: str,
    meta: Mapping[str, Any],
    write: Callable[[Path], None],
) -> Manifest:
    """Write a checkpoint into the free slot of ``path`` and commit it atomically (collective over ``group``).

    ``write(slot_dir)`` runs on every rank of ``group`` (the ranks that write the checkpoint; rank 0
    of it commits) and writes this rank's part.  Every phase is agreed through ``guard``; a failure
    on any rank raises on every rank and leaves the committed checkpoint as it was.
    A ``write`` that runs collectives (Megatron's dist checkpointing) must run them on a group of its
    own that it aborts when it fails on this rank (see ``HdpEngine._checkpoint_group``), so that the
    peers leave them and reach the agreement.

    **One writer at a time.** Rank 0 holds an exclusive lock on ``path/.hdp-save.lock`` (``flock``)
    from before the slot is chosen until after the commit: a second job saving to the same path
    fails at once on every rank naming the path, instead of both reporting success while one job's
    checkpoint is silently lost.  The lock file is removed when the save ends.  (``flock`` is
    local-file-system and NFSv4 semantics; it is not a cross-host lock on every shared file system.)
    """
    root = Path(path)
    lock = _SaveLock(root) if rank == 0 else None
    try:
        return _save_locked(root, lock, guard=guard, group=group, rank=rank, size=size, step=step, format=format,
                            meta=meta, write=write)
    finally:
        if lock is not None:
            lock.release()


class _SaveLock:
    """An exclusive ``flock`` on ``root/.hdp-save.lock`` (taken by :meth:`acquire`, file removed on release).

    Release unlinks the file while holding the lock.  A writer that opened the file before the unlink
    may get the lock on that unlinked inode once it is released, while a third writer creates and locks
    a new file under the same name: both would hold "the" lock.  So :meth:`acquire` checks after
    ``flock`` that its descriptor is still the file at the path (same device and inode) and starts
    again when it is not.
    """

    NAME = ".hdp-save.lock"
    ATTEMPTS = 100
    """Re-opens after losing the race to a releasing writer before giving up (each needs a whole save to pass)."""

    def __init__(self, root: Path) -> None:
        self.path = root / self.NAME
        self.fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(self.ATTEMPTS):
            fd = self._lock_once()
            if fd is not None:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
                self.fd = fd
                return
        raise CheckpointError(
            f"checkpoint {str(self.path.parent)!r}: the save lock {self.NAME} was replaced {self.ATTEMPTS} times "
            "while this job waited for it: other jobs keep saving to this path; give each job its own checkpoint "
            "directory"
        )

    def _lock_once(self) -> int | None:
        """The locked descriptor of the file now at the path, ``None`` when it was unlinked or replaced
        between our open and our flock; :class:`CheckpointError` when another writer holds it."""
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = ""
            try:
                owner = os.pread(fd, 200, 0).decode(errors="replace").strip()
            except OSError:
                pass
            os.close(fd)
            raise CheckpointError(
                f"checkpoint {str(self.path.parent)!r} is being saved by another writer ({owner or 'unknown'}): two "
                "jobs must not save to one path (one job's checkpoints would be silently lost); give each job its own "
                "checkpoint directory"
            ) from None
        mine = os.fstat(fd)
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            return fd
        os.close(fd)  # we locked a file its releaser had already unlinked: that lock protects nothing
        return None

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)  # while still holding the lock: nobody else holds this inode
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def _save_locked(root: Path, lock: "_SaveLock | None", *, guard: StepGuard, group: dist.ProcessGroup, rank: int,
                 size: int, step: int, format: str, meta: Mapping[str, Any], write: Callable[[Path], None]) -> Manifest:
    with guard.phase("save: prepare", step):
        if lock is not None:
            lock.acquire()
        try:
            current = read_manifest(root).slot
        except CheckpointError:
            current = None
        slot = _SLOTS[1] if current == _SLOTS[0] else _SLOTS[0]
        slot_dir = root / slot
        if rank == 0:
            if root.exists() and not root.is_dir():
                raise CheckpointError(f"checkpoint path {str(root)!r} exists and is not a directory")
            root.mkdir(parents=True, exist_ok=True)
            if slot_dir.exists():
                shutil.rmtree(slot_dir)  # left by an interrupted save: never committed
            slot_dir.mkdir()
    with guard.phase("save: write", step):
        with writers_die_with_parent():
            write(slot_dir)
    files = _listing(slot_dir)  # the same listing on every rank: every writer has closed its files
    with guard.phase("save: flush", step):
        for name in _share(files, rank, size):  # each rank flushes a share to stable storage
            fd = os.open(slot_dir / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if rank == 0:
            for d in {slot_dir, *((slot_dir / n).parent for n in files)}:
                _fsync_dir(d)
    digests: dict[str, dict[str, Any]] = {}
    with guard.phase("save: hash", step):
        digests = {name: file_digest(slot_dir / name) for name in _share(files, rank, size)}
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, digests, group=group)
    manifest = Manifest(
        version=MANIFEST_VERSION, format=format, slot=slot, step=int(step), meta=dict(meta),
        files={k: v for d in gathered for k, v in d.items()},
    )
    with guard.phase("save: commit", step):
        if rank == 0:
            if len(manifest.files) != len(files):
                raise CheckpointError(f"save: hashed {len(manifest.files)} of {len(files)} files of {slot_dir}")
            tmp = root / (MANIFEST + ".tmp")
            with tmp.open("w") as fh:
                fh.write(manifest.to_json())
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, root / MANIFEST)  # the commit
            _fsync_dir(root)
    logger.info("checkpoint %s: step %d committed in %s (%d files)", root, step, slot, len(files))
    return manifest


def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    guard: StepGuard,
    rank: int,
    size: int,
    step: int,
    expect: Mapping[str, Any],
    check: Callable[[Manifest], None] | None = None,
) -> Manifest:
    """Verify checkpoint ``path`` on every rank before anything is loaded; return its manifest.

    Checks the manifest, the caller's ``expect`` (keys of ``manifest.meta`` that must be equal, e.g.
    the model-config digest), the caller's ``check(manifest)`` (raises for an incompatible layout),
    and the sha256 and size of every file (each rank a share).  One agreement (through ``guard``):
    a problem on any rank raises on every rank.  Nothing is read into the model here.
    """
    root = Path(path)
    manifest: Manifest | None = None
    with guard.phase("load: verify", step):
        manifest = read_manifest(root)
        wrong = {k: (manifest.meta.get(k), v) for k, v in expect.items() if manifest.meta.get(k) != v}
        if wrong:
            detail = ", ".join(f"{k}: checkpoint {a!r}, this engine {b!r}" for k, (a, b) in wrong.items())
            raise CheckpointError(
                f"checkpoint {str(root)!r} (step {manifest.step}) was written for another model or layout "
                f"({detail}); load it into an engine built with the same configuration"
            )
        if check is not None:
            check(manifest)
        slot_dir = root / manifest.slot
        for name in _share(sorted(manifest.files), rank, size):
            want = manifest.files[name]
            target = slot_dir / name
            if not target.is_file():
                raise CheckpointError(f"checkpoint {str(root)!r}: file {manifest.slot}/{name} is missing")
            got = file_digest(target)
            if got["bytes"] != want["bytes"]:
                raise CheckpointError(
                    f"checkpoint {str(root)!r}: file {manifest.slot}/{name} has {got['bytes']} bytes, the "
                    f"manifest recorded {want['bytes']} (truncated or overwritten)"
                )
            if got["sha256"] != want["sha256"]:
                raise CheckpointError(
                    f"checkpoint {str(root)!r}: file {manifest.slot}/{name} is corrupted (sha256 "
                    f"{got['sha256'][:16]}…, the manifest recorded {want['sha256'][:16]}…)"
                )
    assert manifest is not None
    return manifest


# ---- does the checkpoint fit this engine? one rule for every load, from metadata only ---------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One entry of a checkpoint (or of what an engine loads) without its data: a tensor's global shape and dtype,
    or an object."""

    shape: tuple[int, ...] = ()
    """Global shape (the whole tensor over every rank)."""
    dtype: str | None = None
    """``float32``, ``bfloat16``, ...; ``None`` for an object (a Megatron ``ShardedObject``: its key is its place)."""
    rows_may_differ: bool = False
    """Megatron's ``allow_shape_mismatch`` (a vocabulary padded per layout): its loader pads or cuts dim 0, so only
    the other dims must match.  Set on the engine's side."""

    def __str__(self) -> str:
        return "an object" if self.dtype is None else f"[{', '.join(str(n) for n in self.shape)}] {self.dtype}"

    def accepts(self, saved: "TensorSpec") -> bool:
        """Whether this engine entry loads ``saved`` (the checkpoint's entry of the same key)."""
        if self.dtype is None or saved.dtype is None:
            return self.dtype is None and saved.dtype is None
        lead = 1 if self.rows_may_differ else 0
        return (self.dtype == saved.dtype and len(self.shape) == len(saved.shape)
                and self.shape[lead:] == saved.shape[lead:])


@dataclass(frozen=True, kw_only=True)
class StateView:
    """What a checkpoint holds, or what an engine would load from one, without any tensor data (`fit_problem`)."""

    parts: dict[str, dict[str, TensorSpec]]
    """Part (``model``, ``optimizer``, ...; in the order the engine loads them) -> key -> entry."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Identity that must be equal where both sides record it: the model-config digest, the role, the architecture."""
    layout: dict[str, Any] = field(default_factory=dict)
    """TP / PP / VPP / EP and the sizes: quoted when a checkpoint does not fit (the caller's layout rule decides
    which layout changes a format allows)."""


def merge_views(views: Iterable[StateView]) -> StateView:
    """One view of the whole job from every rank's (each holds its own stages, experts and shards): the union of the
    entries, part by part in first-seen order; ``meta`` and ``layout`` of the first."""
    views = list(views)
    parts: dict[str, dict[str, TensorSpec]] = {}
    for view in views:
        for part, entries in view.parts.items():
            merged = parts.setdefault(part, {})
            for key, spec in entries.items():
                merged.setdefault(key, spec)
    return StateView(parts=parts, meta=dict(views[0].meta), layout=dict(views[0].layout))


def fit_problem(checkpoint: StateView, engine: StateView) -> str | None:
    """Why ``checkpoint`` does not fit ``engine``; ``None`` when it does.

    It fits when every part the engine loads is there with the same keys, each entry of the engine's shape and dtype
    (`TensorSpec.accepts`: dim 0 of a padded vocabulary may differ), and every ``meta`` value both sides record is
    equal.  Else the answer names the first differing entry — parts in the engine's order, keys in the engine's order
    then the checkpoint's extra ones, a padded vocabulary's rows too — with both sides, the first one that cannot
    load if that was not it, how many differ, every differing ``meta`` value, and the two layouts if they differ."""
    diffs: list[tuple[str, str, TensorSpec | None, TensorSpec | None]] = []  # part, key, checkpoint's, engine's
    missing = ""
    for part, mine in engine.parts.items():
        saved = checkpoint.parts.get(part)
        if saved is None:
            missing = f"it holds no {part} (this engine loads {len(mine)} {part} entries)"
            break
        diffs += [(part, key, saved.get(key), spec) for key, spec in mine.items()
                  if key not in saved or (saved[key].shape, saved[key].dtype) != (spec.shape, spec.dtype)]
        diffs += [(part, key, spec, None) for key, spec in saved.items() if key not in mine]
    misfits = [d for d in diffs if d[2] is None or d[3] is None or not d[3].accepts(d[2])]
    wrong = [f"{k}: checkpoint {checkpoint.meta[k]!r}, this engine {v!r}" for k, v in engine.meta.items()
             if checkpoint.meta.get(k) is not None and checkpoint.meta[k] != v]
    if not (missing or misfits or wrong):
        return None

    def entry(d: tuple[str, str, TensorSpec | None, TensorSpec | None]) -> str:
        part, key, theirs, ours = d
        return (f"{part} entry {key!r}: checkpoint {theirs if theirs is not None else 'has none'}, this engine "
                f"{ours if ours is not None else 'has none'}")

    found = []
    if diffs:
        first = entry(diffs[0])
        if misfits and misfits[0] is not diffs[0]:
            first += f"; the first that cannot load: {entry(misfits[0])}"
        found.append(first + (f" ({len(diffs)} entries differ)" if len(diffs) > 1 else ""))
    found += [missing] if missing else []
    found += wrong
    if checkpoint.layout and checkpoint.layout != engine.layout:
        found.append(f"the checkpoint was saved with layout {checkpoint.layout}, this engine has {engine.layout}")
    return "; ".join(found)


def check_fit(path: str | os.PathLike[str], *, guard: StepGuard, step: int, checkpoint: Callable[[], StateView],
              engine: Callable[[], StateView], gather: bool = True) -> None:
    """The rule every checkpoint load goes through before its first write (collective over ``guard.group``).

    ``checkpoint()`` reads what the checkpoint at ``path`` holds from its metadata (no tensor data) and
    ``engine()`` what this rank of the engine would load; with ``gather`` the engine's views of every rank are
    joined (`merge_views`: each rank holds its own stages and shards) and every rank compares the whole; without,
    each rank compares its own (a per-rank format).  A checkpoint that cannot be read, or does not fit
    (`fit_problem`), raises :class:`CheckpointError` through ``guard`` on every rank alike, naming the first
    differing entry and both sides; nothing was written, and the engine stays usable.
    """
    views: list[StateView] = []
    with guard.phase("load: read metadata", step):
        views += [checkpoint(), engine()]
    saved, mine = views
    if gather:
        every: list[Any] = [None] * guard.size
        dist.all_gather_object(every, mine, group=guard.group)
        mine = merge_views(every)
    with guard.phase("load: check fit", step):
        problem = fit_problem(saved, mine)
        if problem is not None:
            raise CheckpointError(f"checkpoint {str(path)!r} does not fit this engine: {problem}. Nothing was loaded; "
                                  "load a checkpoint saved by an engine of this role, model and layout")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def state_tensors(state: Any, prefix: str = "") -> dict[str, TensorSpec]:
    """Every tensor of a nested dict / list / tuple ``state`` by dotted key (``model.decoder.0.weight``), with its
    shape and dtype; other leaves (numbers, strings) are not entries."""
    out: dict[str, TensorSpec] = {}
    if isinstance(state, torch.Tensor):
        out[prefix] = TensorSpec(tuple(state.shape), _dtype_name(state.dtype))
    elif isinstance(state, Mapping):
        for k, v in state.items():
            out.update(state_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(state_tensors(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def torch_file_tensors(path: str | os.PathLike[str]) -> dict[str, TensorSpec]:
    """`state_tensors` of a ``torch.save`` file, memory-mapped (its tensors' data is not read)."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file: name it
        raise CheckpointError(f"checkpoint file {str(path)!r} is unreadable ({describe(exc)})") from exc
    return state_tensors(state)


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def safetensors_tensors(directory: str | os.PathLike[str]) -> dict[str, TensorSpec]:
    """Every tensor of the ``*.safetensors`` files in ``directory`` (a Hugging Face model), from their headers."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(str(directory), "*.safetensors")))
    if not files:
        raise CheckpointError(f"checkpoint {str(directory)!r} holds no *.safetensors files")
    out: dict[str, TensorSpec] = {}
    for name in files:
        with safe_open(name, framework="pt") as fh:
            for key in fh.keys():
                sl = fh.get_slice(key)
                kind = sl.get_dtype()
                dtype = _SAFETENSORS_DTYPES.get(kind, kind.lower())
                out[key] = TensorSpec(tuple(int(n) for n in sl.get_shape()), dtype)
    return out


def _sharded_entries(values: Iterable[Any]) -> dict[str, TensorSpec]:
    from hdp import megatron_compat as mc

    out: dict[str, TensorSpec] = {}
    for v in values:
        if isinstance(v, mc.ShardedTensor):
            out[v.key] = TensorSpec(tuple(int(n) for n in v.global_shape), _dtype_name(v.dtype),
                                    bool(getattr(v, "allow_shape_mismatch", False)))
        elif isinstance(v, mc.ShardedObject):
            out[v.unique_key] = TensorSpec()
    return out


def dist_checkpoint_tensors(directory: str | os.PathLike[str]) -> dict[str, TensorSpec]:
    """Every entry of a Megatron distributed checkpoint (``torch_dist``) from its metadata files: tensors by key with
    their global shape and dtype, objects by their unique key (megatron-core ``load_sharded_metadata``)."""
    from hdp import megatron_compat as mc

    try:
        entries = mc.load_sharded_metadata(str(directory))
    except Exception as exc:  # noqa: BLE001 - CheckpointingException, OSError, unpickling errors: name them
        raise CheckpointError(f"checkpoint {str(directory)!r} is not a readable Megatron distributed checkpoint "
                              f"({describe(exc)})") from exc
    return _sharded_entries(entries.values())


def sharded_state_tensors(sharded_state_dict: Any) -> dict[str, TensorSpec]:
    """Every entry an engine's Megatron sharded state dict saves or loads (global shapes; its factories are built in
    place, so pass a dict made for this call)."""
    from hdp import megatron_compat as mc

    mc.apply_factories(sharded_state_dict)
    return _sharded_entries(mc.nested_values(sharded_state_dict))
