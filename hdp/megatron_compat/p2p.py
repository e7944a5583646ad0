"""Pipeline communication of variable-length micro-batches (hdp's rounds) over Megatron's schedules."""

from __future__ import annotations

import collections
from typing import Any, Sequence

import torch

from hdp.megatron_compat.names import P2PCommunicator, _p2p_ops

__all__ = ["HdpP2PCommunicator", "interleaved_schedule"]



class HdpP2PCommunicator(P2PCommunicator):
    """Megatron's pipeline communicator whose shape exchange pairs messages like its data exchange.

    Why: with ``variable_seq_lengths`` megatron-core 0.16.1 sends each micro-batch's shape first,
    always through ``batch_isend_irecv`` in the order [send_prev, recv_prev, send_next, recv_next].
    With two stages the previous and the next stage are the same rank, and a call that moves both
    directions (the interleaved schedule's ``send_forward_backward_recv_forward_backward``) then pairs
    the forward shape with the backward one: the stages receive each other's shapes swapped (seen
    on gloo; NCCL orders point-to-point messages per peer the same way).  Megatron's non-batched data
    path (``_p2p_ops``, used with ``batch_p2p_comm=False``) avoids that for two stages by sending one
    direction over another group; this communicator exchanges the shapes the same way.  Any device:
    the shape tensors live on ``device``.  Can go when megatron-core's ``_communicate_shapes`` takes
    the ``_p2p_ops`` path (or distinct tags) for two stages.  :meth:`expect_shapes` skips the
    exchange altogether when the caller knows every micro-batch's shape (1F1B), and
    :meth:`expect_interleaved_shapes` for the interleaved schedule.
    """

    def __init__(self, pp_group: Any, config: Any, device: torch.device | str) -> None:
        super().__init__(pp_group=pp_group, config=config)
        self.device = torch.device(device)
        self._known: tuple[collections.deque, collections.deque] | None = None

    def expect_shapes(self, shapes: Sequence[Sequence[int]] | None, *, forward_only: bool = False) -> None:
        """Shapes every stage sends, one per micro-batch in schedule order (``None``: exchange them).

        With the non-interleaved 1F1B schedule a stage receives its forward inputs, and its output
        gradients, each in micro-batch order; when every stage knows every micro-batch's shape (hdp's
        plan fixes them), the receiver takes them from here and no shape message is sent.
        """
        if shapes is None:
            self._known = None
            return
        first, last = self.pp_group.rank() == 0, self.pp_group.rank() == self.pp_group.size() - 1
        self._known = (collections.deque([] if first else shapes),
                       collections.deque([] if last or forward_only else shapes))

    def expect_interleaved_shapes(self, shapes: Sequence[Sequence[int]], num_chunks: int, group_size: int, *,
                                  forward_only: bool = False) -> None:
        """Shapes of the interleaved schedule's messages, from each micro-batch's shape (``None`` exchange).

        ``shapes[i]`` is what every stage sends for micro-batch i (all model chunks alike);
        ``num_chunks`` the virtual stages per rank, ``group_size`` Megatron's
        ``microbatch_group_size_per_vp_stage``.  The interleaved schedule runs virtual micro-batch k
        (forward and backward alike) as micro-batch ``table[k]`` of chunk ``chunks[k]`` (reversed in
        backward), and a stage sends, in k order, every forward output except the last chunk's on
        the last stage and every input gradient except the first chunk's on the first stage; the
        receiver takes them in the same order (P2P messages are ordered per peer).  So each stage
        knows what it will receive without a shape message.  ``forward_only``: no gradients move.
        """
        pp, rank = self.pp_group.size(), self.pp_group.rank()
        table = interleaved_schedule(len(shapes), num_chunks, group_size)
        src_fwd, src_bwd = (rank - 1) % pp, (rank + 1) % pp
        fwd = [shapes[mb] for mb, c in table if not (src_fwd == pp - 1 and c == num_chunks - 1)]
        bwd = [] if forward_only else [shapes[mb] for mb, c in table if not (src_bwd == 0 and num_chunks - 1 - c == 0)]
        self._known = (collections.deque(fwd), collections.deque(bwd))

    def unused_shapes(self) -> int:
        """Expected messages not received (0 after a complete schedule, on every stage)."""
        return 0 if self._known is None else len(self._known[0]) + len(self._known[1])

    def _communicate_shapes(self, tensor_send_next: Any, tensor_send_prev: Any, recv_prev: bool,
                            recv_next: bool) -> tuple[list[int], list[int]]:
        if self._known is not None:
            fwd, bwd = self._known
            if (recv_prev and not fwd) or (recv_next and not bwd):
                raise RuntimeError("HdpP2PCommunicator: more receives than expected micro-batch shapes")
            prev = list(fwd.popleft()) if recv_prev else [0, 0, 0]
            nxt = list(bwd.popleft()) if recv_next else [0, 0, 0]
            return prev, nxt

        def shape_of(t: Any) -> torch.Tensor | None:
            return None if t is None else torch.tensor(t.size(), device=self.device, dtype=torch.int64)

        recv_prev_t = torch.empty((3,), device=self.device, dtype=torch.int64) if recv_prev else None
        recv_next_t = torch.empty((3,), device=self.device, dtype=torch.int64) if recv_next else None
        reqs = _p2p_ops(
            tensor_send_prev=shape_of(tensor_send_prev),
            tensor_recv_prev=recv_prev_t,
            tensor_send_next=shape_of(tensor_send_next),
            tensor_recv_next=recv_next_t,
            group=self.pp_group,
            prev_pipeline_rank=self.prev_rank,
            next_pipeline_rank=self.next_rank,
        )
        for req in reqs.values():
            req.wait()
        prev_shape = recv_prev_t.tolist() if recv_prev_t is not None else [0, 0, 0]
        next_shape = recv_next_t.tolist() if recv_next_t is not None else [0, 0, 0]
        return prev_shape, next_shape


def interleaved_schedule(num_microbatches: int, num_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """(micro-batch, model chunk) of every virtual micro-batch of Megatron's interleaved schedule.

    Megatron's ``get_schedule_table``: micro-batches go in groups of ``group_size``; each group runs
    chunk 0 over its micro-batches, then chunk 1, ...; the last group takes the remainder.
    """
    out: list[tuple[int, int]] = []
    for lo in range(0, num_microbatches, group_size):
        hi = num_microbatches if lo + group_size >= num_microbatches else lo + group_size
        out.extend((mb, c) for c in range(num_chunks) for mb in range(lo, hi))
    return out


