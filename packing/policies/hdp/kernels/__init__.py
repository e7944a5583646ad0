"""The hdp policy's compiled kernels (numba), one module per job:

* `costs` -- the cost model's arithmetic (`CostModel.group_cost`'s operations, in order) and the
  batch-wide figures `Problem` scores plans with;
* `balance` -- balancing items over bins (`bins`), exact LPT in waves, the shelf layout;
* `widening` -- the size a tall sample is widened to (`sizes`);
* `gaps`, `swaps` -- the level pass's gap filling and round swaps;
* `placement` -- where a round's groups sit on a domain over several nodes (`placement`);
* `polish_state`, `polish_survey`, `polish_steps`, `polish_search` -- the polish pass's search: its
  state (one structure per part, `polish_state`), its view of the columns, its steps, its loop.

They use the shared kernels of `hdp.packing.kernels` (sorts, heaps, sums, Karmarkar-Karp) and are
declared through `hdp.packing.kernels.jit`; `warm_up` compiles (or loads from numba's cache) every
one, for the types it declares.
"""

from hdp.packing.kernels import jit, kk, sums
from hdp.packing.policies.hdp.kernels import balance, costs, gaps, placement, polish_search, swaps, widening

__all__ = ["MODULES", "warm_up"]

MODULES = (sums, kk, costs, balance, widening, gaps, swaps, polish_search, placement)
"""Every module declaring a kernel the hdp policy calls."""


def warm_up() -> None:
    """Compile, or load from numba's on-disk cache, every kernel of `MODULES` (`jit.warm_up`)."""
    jit.warm_up(*MODULES)
