"""The door to numba: how the planner's kernels are declared, cached and warmed up.

* `kernel(*argtypes)` declares a kernel Python calls: its argument types, once.  `warm_up` compiles
  exactly those (or loads them from numba's on-disk cache).  A call with other types -- another dtype,
  a strided or a read-only array -- would compile a second version inside a plan; the callers pass
  the declared types (`int_array` makes the int64 arrays), and tests/unit/packing/test_planner_kernels.py
  tests/distributed/packing/test_planner_kernels_dist.py checks
  that planning every bench family compiles nothing beyond the declarations.
* `helper` declares a function only kernels call: typed from its callers, compiled into them.
* `struct_type` gives the numba type of a `typing.NamedTuple` whose field annotations are numba types:
  a kernel's state travels as one such structure (arrays and scalars), not as dozens of arguments.

Determinism: IEEE double arithmetic only -- no ``fastmath`` (no reassociation, no fused
multiply-add: numba emits plain ``fmul``/``fadd``, which LLVM does not contract), no parallel
reductions, ties broken by index with stable sorts -- so the same inputs give the same plan in every
process (tests/unit/packing/test_planner_kernels.py tests/distributed/packing/test_planner_kernels_dist.py plans in
fresh processes; tests/unit/packing/test_planner_golden.py holds
whole plans to committed checksums).

Caching: ``cache=True`` keeps the machine code in ``__pycache__`` beside the source, or, where that
is read-only (a wheel in a system site-packages), in numba's per-user cache (``$NUMBA_CACHE_DIR``,
else ``~/.cache/numba``); where neither is writable every process compiles.  numba stamps a cached
function with its own file only, and a kernel's machine code holds the helpers it calls from other
files: a helper edited in ``sort.py`` would leave every kernel calling it stale.  So every kernel here
is stamped with one digest of all the kernel sources (`SOURCE_DIRS`): an edit to any of them
recompiles them all, as when they were one file (unless ``NUMBA_CACHE_LOCATOR_CLASSES`` names numba's
own locators, which then stamp each file alone).  This reaches into numba's cache classes
(``numba.core.caching``), here and nowhere else.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from numba import njit, types
from numba.core import caching
from numba.core.dispatcher import Dispatcher

__all__ = [
    "kernel", "helper", "warm_up", "kernels_of", "struct_type", "int_array",
    "I64", "F8", "BOOL", "I64_1D", "F8_1D", "B1_1D", "I64_2D", "F8_2D", "F8_3D", "SOURCE_DIRS",
]

I64, F8, BOOL = types.int64, types.float64, types.boolean
I64_1D, F8_1D, B1_1D = types.int64[::1], types.float64[::1], types.boolean[::1]  # writable, C-contiguous
I64_2D, F8_2D, F8_3D = types.int64[:, ::1], types.float64[:, ::1], types.float64[:, :, ::1]

SOURCE_DIRS: tuple[Path, ...] = (
    Path(__file__).resolve().parent,  # hdp.packing.kernels: the shared kernels (sorts, heaps, sums, KK)
    Path(__file__).resolve().parents[1] / "policies" / "hdp" / "kernels",  # the hdp policy's kernels
)
"""The folders of every kernel's source; the cache stamp covers all of their ``.py`` files."""

_DECLARED: dict[str, list[tuple[Dispatcher, tuple[types.Type, ...]]]] = {}  # module -> its kernels


def int_array(a: Any) -> np.ndarray:
    """``a`` as a writable, contiguous int64 array (a copy): the type the kernels declare (numba types
    a read-only or strided array apart, and would compile the kernel again for it)."""
    return np.array(a, dtype=np.int64)


def struct_type(cls: type) -> types.NamedTuple:
    """The numba type of the `typing.NamedTuple` ``cls``, its field annotations numba types (the module
    defining ``cls`` must not use ``from __future__ import annotations``: they are read as objects)."""
    return types.NamedTuple([cls.__annotations__[f] for f in cls._fields], cls)


def kernel(*argtypes: types.Type) -> Callable[[Callable], Dispatcher]:
    """Declare a kernel Python calls, with its argument types (``I64_1D``, ``F8``, ``struct_type(...)``);
    `warm_up` compiles exactly that signature."""

    def wrap(fn: Callable) -> Dispatcher:
        disp = _compiled(fn)
        _DECLARED.setdefault(fn.__module__, []).append((disp, tuple(argtypes)))
        return disp

    return wrap


def helper(fn: Callable) -> Dispatcher:
    """Declare a function kernels call (typed from its callers and compiled into them; callable from
    Python too, where it compiles for the argument types it is given)."""
    return _compiled(fn)


def kernels_of(module: ModuleType) -> list[tuple[Dispatcher, tuple[types.Type, ...]]]:
    """The kernels ``module`` declares, in order, with their argument types."""
    return list(_DECLARED.get(module.__name__, ()))


def warm_up(*modules: ModuleType) -> None:
    """Compile every kernel the ``modules`` declare, for its declared types (numba loads the machine
    code from its on-disk cache when it is there).  Called when a policy's module is imported, so a
    rank pays it once at start and a plan's time is its own."""
    for module in modules:
        for disp, argtypes in kernels_of(module):
            disp.compile(argtypes)


def _compiled(fn: Callable) -> Dispatcher:
    """``fn`` compiled (nopython, no GIL held), its machine code cached on disk under the kernels' digest
    (module docstring); without a writable cache directory it compiles in every process."""
    source = Path(inspect.getfile(fn)).resolve()
    if not any(d in source.parents for d in SOURCE_DIRS):
        raise AssertionError(f"kernel {fn.__qualname__} in {source}: outside SOURCE_DIRS, its cache would go stale")
    disp = njit(nogil=True)(fn)
    try:
        disp._cache = _KernelCache(fn)  # Dispatcher.enable_caching with the kernels' own locators
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        pass
    return disp


@lru_cache(maxsize=1)
def _sources_digest() -> bytes:
    """`_digest` of `SOURCE_DIRS`, once per process."""
    return _digest(SOURCE_DIRS)


def _digest(dirs: tuple[Path, ...]) -> bytes:
    """sha256 of every ``.py`` file of ``dirs`` (folder by folder; names and contents, in name order)."""
    h = hashlib.sha256()
    for d in dirs:
        for path in sorted(d.glob("*.py")):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.digest()


def _stamped(base: type) -> type:
    """numba's cache locator ``base`` with every kernel stamped by `_sources_digest`."""

    class Locator(base):  # type: ignore[misc, valid-type]
        def get_source_stamp(self) -> bytes:
            return _sources_digest()

    Locator.__name__ = Locator.__qualname__ = f"Kernels{base.__name__}"
    return Locator


class _KernelCacheImpl(caching.CompileResultCacheImpl):
    _locator_classes = [_stamped(c) for c in (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator,
                                              caching.UserWideCacheLocator)]


class _KernelCache(caching.FunctionCache):
    _impl_class = _KernelCacheImpl
