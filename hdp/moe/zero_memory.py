"""MoE zero-memory recomputation: free expert activations in forward, recompute them in backward.

Reference behaviour: MindSpeed ``--moe-zero-memory level0|level1`` (written from its description;
device-agnostic, on Megatron-core's ``MoELayer`` with the all-to-all dispatcher).  Every expert kind
Megatron builds is taken (:class:`ExpertKind`): ``SequentialMLP`` (per-expert MLPs), ``GroupedMLP``
(Megatron's grouped GEMM: ``weight1`` [H, L·F1], ``weight2`` [L·F, H]) and ``TEGroupedMLP``
(TransformerEngine's grouped linears, ``linear_fc1.weight{l}`` [F1, H] and ``linear_fc2.weight{l}``
[H, F], as mbridge and Megatron-Bridge build experts on GPUs).  Whatever the kind, the expert GEMMs
inside the zero-memory node run as **one grouped GEMM** per projection and direction
(:mod:`hdp.kernels.grouped_gemm`: torch's ``grouped_mm`` on CPU and CUDA, torch_npu's grouped
matmul on NPU, a loop of matmuls where neither serves).

Dimension legend (one MoE layer on one rank):
    T   tokens of the layer input (flattened [s, b] -> T);  H hidden size
    S   rows sent = T · topk (permutation 1, ordered by expert);  R rows received (local experts)
    F   expert FFN width;  F1 fc1 output width (2F for gated units such as SwiGLU, else F)
    L   local experts;  n_l rows of local expert l (sum_l n_l = R)
    W1  [L, H, F1] fc1 weights as GEMM operands (h_l = x_l W1[l]);  W2 [L, F, H] fc2 weights

The expert path is one autograd node, :class:`_ZeroMemoryExperts` (input x [T, H], permuted probs
[S], expert weights -> the layer's routed output [T, H]), from the permutation to the
unpermutation, so that its backward starts where the layer's backward starts::

    x_perm = x[sorted_indices]                   [S, H]   permutation 1
    x_recv = all_to_all(x_perm)                  [R, H]   dispatch (EP group)
    x_g    = x_recv[group_index]                 [R, H]   regroup by local expert
    h      = grouped_mm(x_g, W1)                 [R, F1]  fc1 (h_l = x_l W1[l])
    z      = (act(h) * p_g[:, None]).to(dt)      [R, F]   activation (SwiGLU: silu(h_a)·h_b) x probs
    y_g    = grouped_mm(z, W2)                   [R, H]   fc2
    y_perm = all_to_all(ungroup(y_g))            [S, H]   combine
    out    = scatter_add(y_perm -> sorted_indices) [T, H] unpermute

Backward GEMMs: dz = grouped_mm(dy, W2ᵀ), dx_g = grouped_mm(dh, W1ᵀ) (input gradients) and the
weight gradients as grouped GEMMs over the row groups (``grouped_mm_wgrad``).  Per-expert weights
(``SequentialMLP``, ``TEGroupedMLP``) are stacked into W1 / W2 at each use (forward, backward),
never saved stacked; ``GroupedMLP``'s are views of its two parameters.

Saved for backward (everything else -- x_perm, x_recv, x_g, act(h), z, y -- is freed in forward):

* ``level0``: x (the layer input; the router keeps it alive anyway), h [R, F1], p_g [R], indices.
  Backward: unpermute backward (gather of d_out) and the combine-grad all-to-all of dy; re-permute
  x and issue the dispatch all-to-all **asynchronously**; recompute act(h) for fc2's weight
  gradient; fc2 input grad; activation and probs backward; fc1 input-gradient GEMM -- all while
  the re-dispatch is in flight -- then wait; the re-received tokens feed only fc1's weight gradient.
* ``level1``: x, the pre-dispatch probs [S] and indices only (h and the received probs are freed).
  Backward: the re-dispatch of x and the probs is issued **first**, at the start of the layer's
  backward, so it overlaps the unpermute backward and the combine-grad all-to-all (issued next,
  asynchronously); then wait for the re-dispatch, recompute fc1 (while dy's all-to-all is still in
  flight), wait for dy, and run the same backward as level0.

Both levels send the input and probs gradients home (combine direction) asynchronously while fc1's
weight gradient runs.  For SwiGLU experts (``activation_func=silu``, no clamp) the activation and
probs backward is written out (the same elementwise ops autograd runs, writing the two halves of
dh in place instead of building a graph and concatenating); other activations go through autograd.

Fused SwiGLU.  Megatron's activation never runs on this path, so Megatron's ``bias_activation_fusion`` and
MindSpeed's ``use_fused_swiglu`` (which patches Megatron's) would not reach it: a layer asked to fuse
(:attr:`ZeroMemoryMoELayer.fused_swiglu`; by default the config's ``bias_activation_fusion``) computes silu(a)·b
with the device's fused kernel (:mod:`hdp.kernels.fusions`: ``torch_npu.npu_swiglu`` on NPU, not run on
hardware) in forward and in the backward's recompute, and the activation's backward through that kernel's own;
where there is none (CPU, CUDA) or the activation is not plain SwiGLU (an offset, a clamp) the plain form runs.

The order of events of a backward can be recorded through a :class:`ZeroMemoryTrace` set on the
layer (``layer.trace``); tests use it to check that the re-dispatch is issued before the GEMM it
hides behind and waited on after it.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hdp import megatron_compat as mc
from hdp.kernels import fusions
from hdp.kernels.grouped_gemm import grouped_mm, grouped_mm_wgrad
from hdp.moe.levels import ZeroMemoryLevel, layer_levels
from hdp.moe.metadata import DispatchMeta, dispatch_meta, permutation_indices

__all__ = [
    "ZeroMemoryLevel",
    "ZeroMemoryTrace",
    "ZeroMemoryMoELayer",
    "ExpertKind",
    "apply_zero_memory",
    "layer_levels",
]

logger = logging.getLogger(__name__)


@dataclass
class ZeroMemoryTrace:
    """Ordered record of the expert path's backward events (for tests and debugging).

    Event names: ``redispatch_issue`` (re-permuted tokens handed to the async all-to-all),
    ``unpermute_backward`` (d_out gathered into the sent-row order), ``combine_grad_issue`` (level1:
    dy's all-to-all issued asynchronously), ``combine_grad_a2a`` (dy received), ``redispatch_wait``
    (re-dispatched tokens received), ``fc1_recompute`` (level1), ``fc2_backward``,
    ``probs_backward``, ``fc1_dgrad_start``, ``fc1_dgrad_end``, ``fc1_wgrad``,
    ``dispatch_grad_a2a_wait``.
    """

    events: list[str] = field(default_factory=list)
    """Event names in the order they happened."""

    def record(self, name: str) -> None:
        """Append event ``name``."""
        self.events.append(name)

    def index(self, name: str) -> int:
        """Position of the first event ``name`` (``ValueError`` naming the events seen if absent)."""
        try:
            return self.events.index(name)
        except ValueError as exc:
            raise ValueError(f"event {name!r} not recorded; recorded: {self.events}") from exc


# --- runtime pieces ----------------------------------------------------------------------------------


def _all_to_all(
    x: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    group: dist.ProcessGroup | None,
    async_op: bool = False,
) -> tuple[torch.Tensor, Any]:
    """Variable-size all-to-all of rows of ``x`` over ``group``; ``(out, work or None)``.

    ``group`` is ``None`` only for a single-rank EP group (then ``x`` is returned as is).
    """
    if group is None:
        return x, None
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(
        out, x, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits),
        group=group, async_op=async_op,
    )
    return out, work


def _wait(*works: Any) -> None:
    """Wait for every non-``None`` async work handle."""
    for w in works:
        if w is not None:
            w.wait()


class ExpertKind(enum.Enum):
    """How a MoE layer's experts hold their weights (the three kinds Megatron-core builds)."""

    SEQUENTIAL = "SequentialMLP"
    """Per-expert MLPs: ``local_experts[l].linear_fc1.weight`` [F1, H], ``.linear_fc2.weight`` [H, F]."""
    GROUPED = "GroupedMLP"
    """Megatron's grouped GEMM (``moe_grouped_gemm=True``, local spec): ``weight1`` [H, L·F1] viewed as
    [L, H, F1], ``weight2`` [L·F, H] viewed as [L, F, H]."""
    TE_GROUPED = "TEGroupedMLP"
    """TransformerEngine's grouped linears (``moe_grouped_gemm=True``, TE spec; mbridge, Megatron-Bridge):
    ``linear_fc1.weight{l}`` [F1, H], ``linear_fc2.weight{l}`` [H, F]."""

    @classmethod
    def of(cls, experts: Any) -> "ExpertKind | None":
        """The kind of a Megatron experts module, ``None`` for any other module."""
        for kind, klass in ((cls.SEQUENTIAL, mc.SequentialMLP), (cls.GROUPED, mc.GroupedMLP),
                            (cls.TE_GROUPED, mc.TEGroupedMLP)):
            if isinstance(experts, klass):
                return kind
        return None


@dataclass(frozen=True)
class _ExpertWeights:
    """The weights of one layer's local experts as grouped-GEMM operands, and their gradients back.

    ``params``: the parameters the zero-memory node takes (its gradients go to them, in this order):
    fc1's then fc2's.  :meth:`fc1_fwd` / :meth:`fc2_fwd` (and ``_bwd`` for the input gradients) build
    the grouped-GEMM operands from them.
    """

    kind: ExpertKind
    num_local: int
    params: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, experts: Any, kind: ExpertKind) -> "_ExpertWeights":
        """The weights of ``experts`` (a module of ``kind``)."""
        n = int(experts.num_local_experts)
        if kind is ExpertKind.SEQUENTIAL:
            mods = list(experts.local_experts)
            params = [m.linear_fc1.weight for m in mods] + [m.linear_fc2.weight for m in mods]
        elif kind is ExpertKind.GROUPED:
            params = [experts.weight1, experts.weight2]
        else:
            params = [getattr(experts.linear_fc1, f"weight{i}") for i in range(n)]
            params += [getattr(experts.linear_fc2, f"weight{i}") for i in range(n)]
        return cls(kind=kind, num_local=n, params=tuple(params))

    # GEMM operands, each contiguous (row-major) where it is built: per-expert weights are stacked for the
    # orientation the GEMM reads (torch's CPU grouped_mm ran 7% faster on a row-major operand than on a
    # transposed view), GroupedMLP's are views of its two parameters.

    def fc1_fwd(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """[L, H, F1]: fc1's forward operand (h_l = x_l W[l])."""
        if self.kind is ExpertKind.GROUPED:
            w = params[0]  # [H, L·F1]
            return w.view(self.num_local, w.shape[0], -1)
        return torch.stack([w.t() for w in params[: self.num_local]])  # L x [F1, H]ᵀ -> [L, H, F1]

    def fc1_bwd(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """[L, F1, H]: fc1's input-gradient operand (dx_l = dh_l W[l])."""
        if self.kind is ExpertKind.GROUPED:
            return self.fc1_fwd(params).transpose(1, 2)
        return torch.stack(tuple(params[: self.num_local]))  # [L, F1, H]

    def fc2_fwd(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """[L, F, H]: fc2's forward operand."""
        if self.kind is ExpertKind.GROUPED:
            w = params[1]  # [L·F, H]
            return w.view(self.num_local, -1, w.shape[1])
        return torch.stack([w.t() for w in params[self.num_local:]])  # L x [H, F]ᵀ -> [L, F, H]

    def fc2_bwd(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """[L, H, F]: fc2's input-gradient operand (dz_l = dy_l W[l])."""
        if self.kind is ExpertKind.GROUPED:
            return self.fc2_fwd(params).transpose(1, 2)
        return torch.stack(tuple(params[self.num_local:]))  # [L, H, F]

    def fc1_grads(self, x_g: torch.Tensor, dh: torch.Tensor, sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Gradients of fc1's parameters from its input x_g [R, H] and output gradient dh [R, F1]."""
        if self.kind is ExpertKind.GROUPED:
            return (grouped_mm_wgrad(x_g, dh, sizes).view(self.params[0].shape),)  # [L, H, F1] -> [H, L·F1]
        return tuple(grouped_mm_wgrad(dh, x_g, sizes).unbind(0))  # L x [F1, H]

    def fc2_grads(self, z: torch.Tensor, dy: torch.Tensor, sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Gradients of fc2's parameters from its input z [R, F] and output gradient dy [R, H]."""
        if self.kind is ExpertKind.GROUPED:
            return (grouped_mm_wgrad(z, dy, sizes).view(self.params[1].shape),)  # [L, F, H] -> [L·F, H]
        return tuple(grouped_mm_wgrad(dy, z, sizes).unbind(0))  # L x [H, F]


@dataclass(frozen=True)
class _ExpertSpec:
    """Non-tensor arguments of :class:`_ZeroMemoryExperts`."""

    level: ZeroMemoryLevel
    meta: DispatchMeta
    group: dist.ProcessGroup | None  # None when ep == 1
    activation: Callable[[torch.Tensor], torch.Tensor]
    trace: ZeroMemoryTrace | None
    weights: _ExpertWeights
    swiglu_offset: float | None = None
    """Set (Megatron's ``glu_linear_offset``; 0 for ``GroupedMLP``) when the activation is plain
    SwiGLU (silu, no clamp): the activation backward then runs the explicit formulas of
    :func:`_swiglu_grads`."""
    swiglu_kernel: fusions.FusedKernel | None = None
    """The device's fused SwiGLU kernel, when the layer fuses and the activation is SwiGLU without offset or
    clamp: it computes the activation in forward and (through its own backward) in :func:`_experts_backward`."""

    def record(self, name: str) -> None:
        """Record event ``name`` on the trace, if one is attached."""
        if self.trace is not None:
            self.trace.record(name)

    @property
    def sizes(self) -> tuple[int, ...]:
        """[L] rows of each local expert in the grouped layout."""
        return self.meta.tokens_per_local_expert


def _regroup(t: torch.Tensor, group_index: torch.Tensor | None) -> torch.Tensor:
    """Received order -> grouped-by-local-expert order (rows)."""
    return t if group_index is None else t.index_select(0, group_index)


def _ungroup(t: torch.Tensor, group_index: torch.Tensor | None) -> torch.Tensor:
    """Grouped order -> received order (inverse of :func:`_regroup`)."""
    return t if group_index is None else torch.empty_like(t).index_copy_(0, group_index, t)


def _act_times_probs(spec: _ExpertSpec, h: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """z = act(h) · p, cast back to h's dtype (Megatron MLP's per_token_scale path)."""
    a = spec.activation(h) if spec.swiglu_kernel is None else fusions.swiglu(h, spec.swiglu_kernel)  # [n, F]
    return (a * p.unsqueeze(-1)).to(a.dtype)


@dataclass
class _SwigluParts:
    """Intermediates of the SwiGLU × probs forward that its backward reuses (rows of h)."""

    a: torch.Tensor  # [n, F] gate half of h (view)
    b: torch.Tensor  # [n, F] linear half of h (+ offset)
    sa: torch.Tensor  # [n, F] silu(a)
    act: torch.Tensor  # [n, F] silu(a) · b


def _swiglu_z(h: torch.Tensor, p: torch.Tensor, offset: float) -> tuple[torch.Tensor, _SwigluParts]:
    """z = (silu(a) · (b + offset) · p).to(dt) [n, F] from h [n, 2F] (gate half a, linear half b) and
    probs p [n]; Megatron MLP's unfused graph, op by op."""
    f = h.shape[1] // 2
    a, b = h[:, :f], h[:, f:]  # [n, F] views
    if offset:
        b = b + offset
    sa = F.silu(a)  # [n, F]
    act = sa * b  # [n, F]
    z = (act * p.unsqueeze(-1)).to(act.dtype)  # [n, F] recomputed activation x probs
    return z, _SwigluParts(a=a, b=b, sa=sa, act=act)


def _swiglu_grads(parts: _SwigluParts, p: torch.Tensor, dz: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """The SwiGLU × probs backward from dz [n, F] (grad of z); writes d h into ``dh`` [n, 2F] and
    returns dp [n].  The elementwise ops autograd runs for :func:`_swiglu_z`'s graph, in its order
    and dtypes (so results equal autograd's)::

        dp = Σ_f dz·act;  dact = dz·p;  db = dact · silu(a);  da = silu_backward(dact · (b + offset), a)
    """
    f = dh.shape[1] // 2
    zdt = torch.promote_types(parts.act.dtype, p.dtype)
    pc = p.unsqueeze(-1)  # [n, 1]
    dzc = dz.to(zdt)
    dp = (dzc * parts.act).sum(-1)  # [n] probs grad (in the promoted dtype, as autograd's mul backward)
    parts.act = None  # type: ignore[assignment]  (freed)
    dact = dzc.mul_(pc).to(dh.dtype)  # [n, F] (dzc is dz itself or its fresh up-cast: free to overwrite)
    torch.mul(dact, parts.sa, out=dh[:, f:])  # d b
    parts.sa = None  # type: ignore[assignment]
    dsa = dact.mul_(parts.b)  # [n, F] d silu(a)
    torch.ops.aten.silu_backward.grad_input(dsa, parts.a, grad_input=dh[:, :f])  # d a
    return dp.to(p.dtype)


def _experts_backward(
    spec: _ExpertSpec, h_g: torch.Tensor, p_g: torch.Tensor, dy_g: torch.Tensor, w2b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """fc2 and activation × probs backward of all local experts from fc1's output h_g [R, F1], the
    received probs p_g [R], fc2's output gradient dy_g [R, H] and fc2's input-gradient operand w2b
    [L, H, F]; ``(dh [R, F1], dp [R], fc2 grads)``."""
    sizes = spec.sizes
    if spec.swiglu_kernel is not None:
        return _fused_swiglu_backward(spec, h_g, p_g, dy_g, w2b)
    if spec.swiglu_offset is not None:
        dh_g = torch.empty_like(h_g)  # [R, F1]
        z, parts = _swiglu_z(h_g, p_g, spec.swiglu_offset)  # [R, F]
        dw2 = spec.weights.fc2_grads(z, dy_g, sizes)  # fc2 weight grads
        del z
        dz = grouped_mm(dy_g, w2b, sizes)  # [R, F] fc2 input grad
        dp_g = _swiglu_grads(parts, p_g, dz, dh_g)
        return dh_g, dp_g, dw2
    with torch.enable_grad():
        h_l = h_g.detach().requires_grad_(True)
        p_l = p_g.detach().requires_grad_(True)
        z = _act_times_probs(spec, h_l, p_l)  # recomputed activation [R, F]
    dw2 = spec.weights.fc2_grads(z.detach(), dy_g, sizes)
    dz = grouped_mm(dy_g, w2b, sizes)  # [R, F]
    dh_g, dp_g = torch.autograd.grad(z, (h_l, p_l), dz)  # activation and probs backward
    return dh_g, dp_g, dw2


def _fused_swiglu_backward(
    spec: _ExpertSpec, h_g: torch.Tensor, p_g: torch.Tensor, dy_g: torch.Tensor, w2b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """:func:`_experts_backward` with the fused SwiGLU kernel: the activation recomputed by the kernel and its
    backward through the kernel's own (autograd); the probs backward and fc2 as in :func:`_swiglu_grads`::

        act = swiglu(h);  z = (act·p).to(dt);  dp = Σ_f dz·act;  dact = dz·p;  dh = swiglu'(h)ᵀ dact
    """
    assert spec.swiglu_kernel is not None
    with torch.enable_grad():
        h_l = h_g.detach().requires_grad_(True)
        act = fusions.swiglu(h_l, spec.swiglu_kernel)  # [R, F] recomputed by the kernel
    a = act.detach()
    z = (a * p_g.unsqueeze(-1)).to(a.dtype)  # [R, F]
    dw2 = spec.weights.fc2_grads(z, dy_g, spec.sizes)  # fc2 weight grads
    del z
    dz = grouped_mm(dy_g, w2b, spec.sizes)  # [R, F] fc2 input grad
    dzc = dz.to(torch.promote_types(a.dtype, p_g.dtype))
    dp_g = (dzc * a).sum(-1).to(p_g.dtype)  # [R] probs grad
    dact = dzc.mul_(p_g.unsqueeze(-1)).to(h_g.dtype)  # [R, F]
    (dh_g,) = torch.autograd.grad(act, h_l, dact)  # [R, F1] through the kernel's backward
    return dh_g, dp_g, dw2


class _ZeroMemoryExperts(torch.autograd.Function):
    """permute -> dispatch -> local experts -> combine -> unpermute with explicit saved tensors.

    See the module docstring.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        spec: _ExpertSpec,
        x: torch.Tensor,
        probs_perm: torch.Tensor,
        sorted_indices: torch.Tensor,
        group_index: torch.Tensor | None,
        *weights: torch.Tensor,
    ) -> torch.Tensor:
        meta = spec.meta
        level0 = spec.level is ZeroMemoryLevel.LEVEL0
        x_perm = x.index_select(0, sorted_indices)  # [S, H]
        x_recv, _ = _all_to_all(x_perm, meta.output_splits, meta.input_splits, spec.group)  # [R, H]
        p_recv, _ = _all_to_all(probs_perm, meta.output_splits, meta.input_splits, spec.group)  # [R]
        del x_perm
        x_g = _regroup(x_recv, group_index)  # [R, H]
        p_g = _regroup(p_recv, group_index)  # [R]
        del x_recv, p_recv
        hidden = x_g.shape[1]
        h_g = grouped_mm(x_g, spec.weights.fc1_fwd(weights), spec.sizes)  # fc1 [R, F1]
        del x_g
        z = _act_times_probs(spec, h_g, p_g)  # [R, F]
        if not level0:
            del h_g  # level1 recomputes fc1 in backward
        y_g = grouped_mm(z, spec.weights.fc2_fwd(weights), spec.sizes)  # fc2 [R, H]
        del z
        y_perm, _ = _all_to_all(_ungroup(y_g, group_index), meta.input_splits, meta.output_splits, spec.group)
        del y_g
        # unpermute (Megatron's moe_utils.unpermute without merging probs): scatter-add rows home
        out = torch.zeros((x.shape[0], hidden), dtype=y_perm.dtype, device=y_perm.device)
        out.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, hidden), y_perm)  # [T, H]
        ctx.spec = spec
        ctx.has_group_index = group_index is not None
        gi = group_index if group_index is not None else sorted_indices.new_empty(0)
        if level0:
            ctx.save_for_backward(x, sorted_indices, gi, h_g, p_g, *weights)
        else:
            del p_g
            ctx.save_for_backward(x, sorted_indices, gi, probs_perm, *weights)
        return out  # [T, H]

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        spec: _ExpertSpec = ctx.spec
        meta = spec.meta
        sizes = spec.sizes
        level0 = spec.level is ZeroMemoryLevel.LEVEL0
        if level0:
            x, sorted_indices, gi, h_g, p_g, *weights = ctx.saved_tensors
        else:
            x, sorted_indices, gi, probs_perm, *weights = ctx.saved_tensors
        group_index = gi if ctx.has_group_index else None
        fwd = (meta.output_splits, meta.input_splits)  # dispatch direction (out, in)
        bwd = (meta.input_splits, meta.output_splits)  # combine direction

        if level0:
            dy_perm = d_out.index_select(0, sorted_indices)  # [S, H] unpermute backward
            spec.record("unpermute_backward")
            # grad of the combine all-to-all: needed by everything below, so synchronous
            dy_recv, _ = _all_to_all(dy_perm, *fwd, spec.group)  # [R, H]
            del dy_perm
            spec.record("combine_grad_a2a")
            # re-permute the saved layer input and re-issue the dispatch; hidden behind the GEMMs below
            x_re, x_work = _all_to_all(x.index_select(0, sorted_indices), *fwd, spec.group, async_op=True)
            spec.record("redispatch_issue")
            x_g: torch.Tensor | None = None
            dy_g = _regroup(dy_recv, group_index)  # [R, H]
            del dy_recv
        else:
            # level1: the re-dispatch goes first, at the very start of the layer's backward; the
            # unpermute backward and dy's all-to-all (issued next) overlap it
            x_re, x_work = _all_to_all(x.index_select(0, sorted_indices), *fwd, spec.group, async_op=True)
            p_re, p_work = _all_to_all(probs_perm, *fwd, spec.group, async_op=True)
            spec.record("redispatch_issue")
            dy_perm = d_out.index_select(0, sorted_indices)  # [S, H] unpermute backward
            spec.record("unpermute_backward")
            dy_recv, dy_work = _all_to_all(dy_perm, *fwd, spec.group, async_op=True)
            del dy_perm
            spec.record("combine_grad_issue")
            w1f = spec.weights.fc1_fwd(weights)  # [L, H, F1] (built while the re-dispatch is in flight)
            _wait(x_work, p_work)
            spec.record("redispatch_wait")
            x_g = _regroup(x_re, group_index)  # [R, H]
            p_g = _regroup(p_re, group_index)  # [R]
            del x_re, p_re
            h_g = grouped_mm(x_g, w1f, sizes)  # [R, F1] recompute fc1 (dy's all-to-all in flight)
            del w1f
            spec.record("fc1_recompute")
            _wait(dy_work)
            spec.record("combine_grad_a2a")
            dy_g = _regroup(dy_recv, group_index)  # [R, H]
            del dy_recv

        dh_g, dp_g, dw2 = _experts_backward(spec, h_g, p_g, dy_g, spec.weights.fc2_bwd(weights))
        spec.record("fc2_backward")
        spec.record("probs_backward")
        del h_g, p_g, dy_g

        spec.record("fc1_dgrad_start")
        dx_g = grouped_mm(dh_g, spec.weights.fc1_bwd(weights), sizes)  # [R, H] fc1 input grad
        spec.record("fc1_dgrad_end")
        # input and probs gradients go home (combine direction) while fc1's weight gradient runs
        dx_perm, dx_work = _all_to_all(_ungroup(dx_g, group_index), *bwd, spec.group, async_op=True)
        dp_perm, dp_work = _all_to_all(_ungroup(dp_g, group_index), *bwd, spec.group, async_op=True)
        del dx_g, dp_g

        if level0:
            _wait(x_work)
            spec.record("redispatch_wait")
            x_g = _regroup(x_re, group_index)  # [R, H]
            del x_re
        assert x_g is not None
        dw1 = spec.weights.fc1_grads(x_g, dh_g, sizes)  # fc1 weight grads
        spec.record("fc1_wgrad")
        del x_g, dh_g

        _wait(dx_work, dp_work)
        spec.record("dispatch_grad_a2a_wait")
        dx = torch.zeros_like(x).index_add_(0, sorted_indices, dx_perm)  # [T, H] (permute's backward)
        return (None, dx, dp_perm, None, None, *dw1, *dw2)


# --- the layer -----------------------------------------------------------------------------------------


def _expert_activation(config: Any, kind: ExpertKind) -> Callable[[torch.Tensor], torch.Tensor]:
    """Activation of the experts: the non-fused path of Megatron's ``MLP`` (``SequentialMLP``) and of
    ``TEGroupedMLP`` (gated: clamp and ``glu_linear_offset`` applied), or ``GroupedMLP``'s own
    (gated: ``act(h_a) · h_b``, no clamp, no offset)."""
    act = config.activation_func
    if not config.gated_linear_unit:
        return act
    if kind is ExpertKind.GROUPED:

        def grouped_glu(h: torch.Tensor) -> torch.Tensor:
            x_glu, x_linear = torch.chunk(h, 2, dim=-1)  # [n, F] each
            return act(x_glu) * x_linear

        return grouped_glu
    clamp = config.activation_func_clamp_value
    offset = config.glu_linear_offset

    def glu(h: torch.Tensor) -> torch.Tensor:
        x_glu, x_linear = torch.chunk(h, 2, dim=-1)  # [n, F] each
        if clamp is not None:
            x_glu = x_glu.clamp(min=None, max=clamp)
            x_linear = x_linear.clamp(min=-clamp, max=clamp)
        return act(x_glu) * (x_linear + offset)

    return glu


def _swiglu_offset(config: Any, kind: ExpertKind) -> float | None:
    """The linear half's offset when the expert activation is plain SwiGLU (gated silu, no clamp):
    ``glu_linear_offset`` (``GroupedMLP``: 0, it applies neither), else None."""
    if not (config.gated_linear_unit and config.activation_func is F.silu):
        return None
    if kind is ExpertKind.GROUPED:
        return 0.0
    if config.activation_func_clamp_value is None:
        return float(config.glu_linear_offset)
    return None


class ZeroMemoryMoELayer(mc.MoELayer):
    """Megatron ``MoELayer`` whose expert path (dispatch -> experts -> combine) frees activations.

    Same parameters, state-dict names and numerics as ``MoELayer``; with ``ZeroMemoryLevel.NONE``
    it *is* ``MoELayer.forward``.  Supported configuration (checked when a level other than NONE is
    set): all-to-all dispatcher; ``SequentialMLP``, ``GroupedMLP`` or ``TEGroupedMLP`` experts
    (:class:`ExpertKind`) without bias; expert TP = 1, dropless (no capacity factor / padding), no
    fp8/fp4, no latent projections, no shared-expert overlap, and not combined with Megatron's own
    ``moe`` recompute.

    ``trace``: optional :class:`ZeroMemoryTrace` receiving the backward's event order.
    ``fused_swiglu``: compute the experts' SwiGLU with the device's fused kernel (module docstring, "Fused
    SwiGLU"); ``None``: as the config's ``bias_activation_fusion`` says.
    """

    def __init__(
        self,
        config: Any,
        submodules: Any = None,
        layer_number: int | None = None,
        pg_collection: Any = None,
        zero_memory_level: ZeroMemoryLevel | str = ZeroMemoryLevel.NONE,
    ) -> None:
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
        self.zero_memory_level = ZeroMemoryLevel.NONE
        self.trace: ZeroMemoryTrace | None = None
        self.fused_swiglu: bool | None = None
        self.set_zero_memory_level(zero_memory_level)

    @classmethod
    def from_moe_layer(cls, layer: Any, level: ZeroMemoryLevel | str) -> "ZeroMemoryMoELayer":
        """A ``ZeroMemoryMoELayer`` sharing every submodule and parameter of ``layer`` (a ``MoELayer``).

        The new module holds the same parameter objects under the same names, so optimizers, DDP
        hooks and state dicts built on the old module keep working.
        """
        if not isinstance(layer, mc.MoELayer):
            raise TypeError(f"from_moe_layer: expected a Megatron MoELayer, got {type(layer).__name__}")
        if isinstance(layer, cls):
            layer.set_zero_memory_level(level)
            return layer
        new = cls.__new__(cls)
        new.__dict__.update(layer.__dict__)  # shares _modules/_parameters/_buffers dicts
        new.zero_memory_level = ZeroMemoryLevel.NONE
        new.trace = None
        new.fused_swiglu = None
        new.set_zero_memory_level(level)
        return new

    def set_zero_memory_level(self, level: ZeroMemoryLevel | str) -> None:
        """Switch this layer's level (validated against the layer's configuration)."""
        level = ZeroMemoryLevel.parse(level)
        if level is not ZeroMemoryLevel.NONE:
            self._check_supported(level)
        self.zero_memory_level = level

    def _check_supported(self, level: ZeroMemoryLevel) -> None:
        cfg = self.config
        where = f"moe zero-memory {level.value} (layer {self.layer_number})"
        problems = []
        if cfg.moe_token_dispatcher_type != "alltoall":
            problems.append(f"moe_token_dispatcher_type={cfg.moe_token_dispatcher_type!r} (needs 'alltoall')")
        kind = ExpertKind.of(self.experts)
        if kind is None:
            problems.append(f"experts are {type(self.experts).__name__} (zero-memory takes "
                            + ", ".join(k.value for k in ExpertKind) + ")")
        elif kind is ExpertKind.TE_GROUPED:
            n = int(self.experts.num_local_experts)
            for proj in ("linear_fc1", "linear_fc2"):
                names = {name for name, _ in getattr(self.experts, proj).named_parameters()}
                if names != {f"weight{i}" for i in range(n)}:
                    problems.append(f"TEGroupedMLP {proj} holds {sorted(names)} (needs weight0..weight{n - 1}, "
                                    "one [out, in] weight per expert)")
        if cfg.add_bias_linear:
            problems.append("add_bias_linear=True (expert biases are not supported)")
        if (cfg.expert_tensor_parallel_size or 1) != 1:
            problems.append(f"expert_tensor_parallel_size={cfg.expert_tensor_parallel_size} (needs 1)")
        if cfg.moe_expert_capacity_factor is not None or cfg.moe_pad_expert_input_to_capacity:
            problems.append("token dropping / capacity padding (needs dropless routing)")
        if cfg.moe_router_padding_for_quantization or cfg.fp8 or cfg.fp4:
            problems.append("fp8/fp4 or router padding for quantization")
        if cfg.moe_latent_size:
            problems.append("moe_latent_size (latent projections)")
        if cfg.moe_apply_probs_on_input:
            problems.append("moe_apply_probs_on_input=True")
        if self.use_shared_expert and self.shared_expert_overlap:
            problems.append("moe_shared_expert_overlap=True")
        if self.moe_layer_recompute:
            problems.append("recompute_modules contains 'moe' (choose Megatron's recompute or zero-memory)")
        if cfg.use_te_activation_func:
            problems.append("use_te_activation_func=True")
        if problems:
            raise ValueError(f"{where}: unsupported configuration: " + "; ".join(problems))

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        intermediate_tensors: Any = None,
        padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        """MoE forward; the expert path is :class:`_ZeroMemoryExperts` unless the level is NONE."""
        if self.zero_memory_level is ZeroMemoryLevel.NONE:
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        if intermediate_tensors is not None:
            raise ValueError("moe zero-memory: intermediate_tensors (partial CUDA-graph capture) is not supported")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()  # [b, s] -> [s, b], as MoELayer does
        shared_out = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)  # [T, E] each
        hidden = hidden_states.shape[-1]
        x = hidden_states.reshape(-1, hidden)  # [T, H]
        meta = self._dispatch_meta(routing_map)
        sorted_indices = permutation_indices(routing_map)  # [S]
        probs_perm = probs.T.contiguous().masked_select(routing_map.T.contiguous())  # [S]
        group_index = None if meta.group_index is None else meta.group_index.to(x.device)
        kind = ExpertKind.of(self.experts)
        assert kind is not None  # _check_supported
        weights = _ExpertWeights.of(self.experts, kind)
        spec = _ExpertSpec(
            level=self.zero_memory_level,
            meta=meta,
            group=self.ep_group if meta.ep_size > 1 else None,
            activation=_expert_activation(self.experts.config, kind),
            trace=self.trace,
            weights=weights,
            swiglu_offset=_swiglu_offset(self.experts.config, kind),
            swiglu_kernel=self._swiglu_kernel(kind, x.device),
        )
        out = _ZeroMemoryExperts.apply(spec, x, probs_perm, sorted_indices, group_index, *weights.params)  # [T, H]
        out = out.to(hidden_states.dtype).view(hidden_states.shape)
        if shared_out is not None:
            out = out + shared_out
        return out, None

    def _swiglu_kernel(self, kind: ExpertKind, device: torch.device) -> fusions.FusedKernel | None:
        """The fused SwiGLU kernel this layer's experts run, if it fuses (:attr:`fused_swiglu`, else the config's
        ``bias_activation_fusion``), the activation is SwiGLU without offset or clamp and the device has one."""
        cfg = self.experts.config
        fuse = self.fused_swiglu if self.fused_swiglu is not None else bool(getattr(cfg, "bias_activation_fusion", False))
        if not fuse:
            return None
        unfit = None
        if _swiglu_offset(cfg, kind) != 0.0:
            unfit = ("the experts' activation is not SwiGLU without an offset or clamp (activation_func, "
                     "glu_linear_offset, activation_func_clamp_value)")
        return fusions.resolve(fusions.Fusion.SWIGLU, device, unfit=unfit)

    def _dispatch_meta(self, routing_map: torch.Tensor) -> DispatchMeta:
        """Gather every EP rank's tokens-per-expert over the (explicit) EP group; build the metadata."""
        local = routing_map.sum(dim=0).long()  # [E]
        ep = self.ep_group.size()
        if ep == 1:
            return dispatch_meta(local.unsqueeze(0), 0)
        counts = [torch.empty_like(local) for _ in range(ep)]
        dist.all_gather(counts, local, group=self.ep_group)
        return dispatch_meta(torch.stack(counts), self.ep_group.rank())  # [ep, E]


# --- applying a level to a model ------------------------------------------------------------------------


def _moe_parents(model: torch.nn.Module) -> Iterable[tuple[torch.nn.Module, str, Any]]:
    """(parent, attribute, MoELayer) for every MoE layer of ``model`` in module order."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, mc.MoELayer):
                yield parent, name, child


def apply_zero_memory(
    model: torch.nn.Module,
    level: ZeroMemoryLevel | str,
    first_n_layers: int | None = None,
    *,
    fused_swiglu: bool | None = None,
) -> list[ZeroMemoryMoELayer]:
    """Set the zero-memory level of every MoE layer of a built model (one pipeline stage).

    Each Megatron ``MoELayer`` is replaced in its parent by a :class:`ZeroMemoryMoELayer` that shares
    its parameters and submodules (same names, same tensors: call this before or after building DDP
    and the optimizer).  Layers are ordered by ``layer_number``; see :func:`layer_levels` for
    ``first_n_layers``.  ``fused_swiglu``: :attr:`ZeroMemoryMoELayer.fused_swiglu` of every layer (``None``: the
    config's ``bias_activation_fusion``).  Returns the zero-memory layers in that order.
    """
    found = sorted(_moe_parents(model), key=lambda t: (t[2].layer_number or 0))
    levels = layer_levels(level, len(found), first_n_layers)
    out = []
    for (parent, name, layer), lv in zip(found, levels):
        zm = ZeroMemoryMoELayer.from_moe_layer(layer, lv)
        zm.fused_swiglu = fused_swiglu
        if zm is not layer:
            setattr(parent, name, zm)
        out.append(zm)
    logger.debug("moe zero-memory: %s", [lv.value for lv in levels])
    return out

