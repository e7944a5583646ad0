"""``hdp bench memory --only logprobs``: peak bytes and time of the two log-prob paths, side by side in one run.

What runs is the last stage's output path of one round, on one process (no TP), at the shape given
(default T = 8,192 tokens, V = 151,936, bf16):

* **logits path** — what Megatron's output layer and `hdp.logprobs` do: ``logits = h @ Wᵀ`` [T, V], then
  `hdp.logprobs.logprobs_entropy` (chunked online log-sum-exp); in a training round the backward builds
  d logits [T, V] and the output layer's ``dh = d logits @ W``, ``dW = d logitsᵀ @ h``;
* **fused path** — `hdp.fused_logprobs.fused_logprobs_entropy` on ``h`` and ``W``.

Each path runs a **log-prob pass** (no grad: log-probs and entropies) and a **training round** (log-probs and
entropies with grad, a loss Σ g_lp·logp + g_H·H with fixed random per-token weights, backward to ``h`` and
``W``).  Memory: every storage an ATen op creates is counted from its creation until it is freed (a
``TorchDispatchMode`` that holds a weak reference to each new storage; the inputs ``h`` and ``W`` are not
counted), and the peak of the live sum is reported — whole, and without ``W``'s gradient (a parameter-sized
tensor both paths produce, which Megatron adds into its fp32 gradient buffer: not an activation).  Time: the
paths alternate, ``repeats`` pairs per kind, medians and the spread (min, max) of each, and the median of the
per-pair ratios.  The memory model's logits term (`hdp.packing.memory.logits_bytes`) of each path is reported
beside the measured bytes.  The targets (checked, reported in ``targets``): at the default shape each fused
kind peaks at ≤ 1/4 of the logits path's bytes beyond the weight gradient, at ≤ 1.2x its median time.
"""

from __future__ import annotations

import gc
import statistics
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes", "bench_logprobs", "TOKENS", "VOCAB", "HIDDEN"]

TOKENS, VOCAB, HIDDEN = 8192, 151936, 256
"""The default shape: the issue's T and Qwen3's vocabulary; a narrow hidden size keeps the CPU run short (the
logits path's bytes do not depend on it; the fused path's grow with it: ``T · H · 4`` and the weight gradient)."""
MEMORY_RATIO, TIME_RATIO = 0.25, 1.2


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every storage an op creates while it lives; ``peak`` the most alive at once.
    ``events`` ((+/-) bytes, allocation id) in order, for peaks without some allocations (`peak_without`)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.events: list[tuple[int, int]] = []
        self._ids: dict[int, int] = {}  # data_ptr of a live counted storage -> its allocation id
        self._next = 0

    def _free(self, ptr: int, nbytes: int, ident: int) -> None:
        self.live -= nbytes
        self.events.append((-nbytes, ident))
        if self._ids.get(ptr) == ident:
            del self._ids[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            st = t.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
            if nbytes == 0 or ptr in inputs or ptr in self._ids:
                continue
            ident, self._next = self._next, self._next + 1
            self._ids[ptr] = ident
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self.events.append((nbytes, ident))
            weakref.finalize(st, self._free, ptr, nbytes, ident)
        return out

    def ident_of(self, t: torch.Tensor) -> int | None:
        """The allocation id of ``t``'s storage while it is alive and counted."""
        return self._ids.get(t.untyped_storage().data_ptr())

    def peak_without(self, ident: int | None) -> int:
        """The peak of the live bytes with allocation ``ident`` left out."""
        live = peak = 0
        for nbytes, i in self.events:
            if i != ident:
                live += nbytes
                peak = max(peak, live)
        return peak


def _inputs(tokens: int, vocab: int, hidden: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden": torch.randn(tokens, hidden, generator=g).to(dtype),  # [T, H]
        "weight": (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).to(dtype),  # [V, H]
        "targets": torch.randint(0, vocab, (tokens,), generator=g),  # [T]
        "g_lp": torch.randn(tokens, generator=g),  # [T] per-token loss weights
        "g_h": torch.randn(tokens, generator=g) * 0.01,
    }


def _run(path: str, train: bool, x: dict[str, torch.Tensor], group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """One log-prob pass (``train`` False) or training round of ``path``; returns W and its gradient holder."""
    from hdp.fused_logprobs import fused_logprobs_entropy
    from hdp.logprobs import logprobs_entropy

    h = x["hidden"].detach().requires_grad_(train)
    w = x["weight"].detach().requires_grad_(train)
    with torch.set_grad_enabled(train):
        if path == "logits":
            logits = h @ w.t()  # [T, V] Megatron's output layer (no TP)
            lp, ent = logprobs_entropy(logits, x["targets"], group, entropy=True)
            del logits
        else:
            lp, ent = fused_logprobs_entropy(h, w, x["targets"], group, entropy=True)
        if train:
            ((lp.float() * x["g_lp"]).sum() + (ent.float() * x["g_h"]).sum()).backward()
    return w, lp.detach()


def _measure(path: str, train: bool, x: dict[str, torch.Tensor], group: dist.ProcessGroup) -> dict[str, int]:
    gc.collect()
    with LiveBytes() as meter:
        w, _ = _run(path, train, x, group)
        grad = meter.ident_of(w.grad) if w.grad is not None else None
    return {"peak_bytes": meter.peak, "peak_bytes_beyond_weight_grad": meter.peak_without(grad),
            "weight_grad_bytes": int(w.grad.nbytes) if w.grad is not None else 0}


def bench_logprobs(tokens: int = TOKENS, vocab: int = VOCAB, hidden: int = HIDDEN, *, dtype: str = "bfloat16",
                   repeats: int = 3, seed: int = 0) -> dict[str, Any]:
    """The two paths side by side (see the module docstring); a one-rank gloo group is made when
    torch.distributed is not initialised (and destroyed after)."""
    from hdp.packing.memory import logits_bytes

    made = False
    if not dist.is_initialized():
        import tempfile

        store = dist.FileStore(tempfile.mktemp(prefix="hdp-bench-logprobs-"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        made = True
    try:
        group = dist.new_group([dist.get_rank()])
        dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
        x = _inputs(tokens, vocab, hidden, dt, seed)
        b = dt.itemsize if hasattr(dt, "itemsize") else torch.tensor([], dtype=dt).element_size()
        # the two paths agree (a check that both computed the same thing)
        lp0, lp1 = (_run(p, False, x, group)[1] for p in ("logits", "fused"))
        agree = float((lp0.float() - lp1.float()).abs().max())
        kinds: dict[str, Any] = {}
        for kind, train in (("logprob_pass", False), ("training_round", True)):
            row: dict[str, Any] = {p: _measure(p, train, x, group) for p in ("logits", "fused")}
            times: dict[str, list[float]] = {"logits": [], "fused": []}
            for r in range(repeats):
                for p in (("logits", "fused") if r % 2 == 0 else ("fused", "logits")):
                    gc.collect()
                    t0 = time.perf_counter()
                    _run(p, train, x, group)
                    times[p].append(time.perf_counter() - t0)
            for p in ("logits", "fused"):
                row[p]["seconds_median"] = statistics.median(times[p]) if times[p] else None
                row[p]["seconds_spread"] = [min(times[p]), max(times[p])] if times[p] else None
                row[p]["seconds"] = times[p]
                row[p]["model_logits_term_bytes"] = logits_bytes(float(tokens), hidden, float(vocab), b,
                                                                 fused=p == "fused") if train else None
            key = "peak_bytes_beyond_weight_grad"
            row["memory_ratio"] = row["fused"][key] / max(row["logits"][key], 1)
            pairs = [f / max(g, 1e-12) for f, g in zip(times["fused"], times["logits"])]
            row["time_ratio_median"] = statistics.median(pairs) if pairs else None
            row["time_ratio_spread"] = [min(pairs), max(pairs)] if pairs else None
            kinds[kind] = row
        targets = {k: {"memory_ratio": v["memory_ratio"], "memory_ok": v["memory_ratio"] <= MEMORY_RATIO,
                       "time_ratio_median": v["time_ratio_median"],
                       "time_ok": v["time_ratio_median"] is None or v["time_ratio_median"] <= TIME_RATIO}
                   for k, v in kinds.items()}
        return {"shape": {"tokens": tokens, "vocab": vocab, "hidden": hidden, "dtype": dtype},
                "threads": torch.get_num_threads(), "repeats": repeats, "max_abs_logprob_diff": agree,
                **kinds, "targets": targets,
                "passed": all(t["memory_ok"] and t["time_ok"] for t in targets.values())}
    finally:
        if made:
            dist.destroy_process_group()
