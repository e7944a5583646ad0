"""Where a round's groups sit on a domain over several nodes, compiled (`placement`'s inner loops).

Both kernels take the columns of every round sorted by (round, width descending, height across
nodes descending, index) -- ``order``, with ``bounds`` [R + 1] its rounds' ranges -- and write every
column's first rank into ``out``; a group wider than the largest node (``largest``) crosses a
boundary wherever it sits, a narrower one is kept inside a node where the round's ranks allow.

* `place_any` (contiguous ranges of any size) walks the ranks node by node: a node starts with the
  widest group wider than any node still to place (it then spans the fewest nodes), then takes the
  widest group that fits its free ranks (the tallest of that width); when none fits it leaves the
  rest of the node idle if the round's idle ranks allow it, and otherwise a group must cross into
  the next node -- the one whose height across nodes raises the round's top least (the narrowest
  among equals, the lowest of its width).
* `place_pow2` (aligned power-of-two blocks) gives every block, widest first, the first free
  aligned slot inside one node, or the first free aligned slot when none is inside one; a round
  whose blocks then find no slot is marked ``-1`` (its given layout stays).
"""

import numpy as np

from hdp.packing.kernels.jit import F8_1D, I64, I64_1D, kernel

__all__ = ["place_any", "place_pow2"]


@kernel(I64_1D, I64_1D, I64_1D, F8_1D, F8_1D, I64_1D, I64_1D, I64, I64_1D)
def place_any(order, bounds, width, h_in, h_x, first, node_of, largest, out):
    """Contiguous groups placed node by node (module docstring): ``out[c]`` the first rank of column c."""
    N = node_of.size
    g_w = np.empty(order.size, dtype=np.int64)  # per width class of a round: width, next head, tail end
    g_head = np.empty(order.size, dtype=np.int64)
    g_tail = np.empty(order.size, dtype=np.int64)
    for r in range(bounds.size - 1):
        a, b = bounds[r], bounds[r + 1]
        if b == a:
            continue
        top = 0.0  # the round's top when only the groups wider than a node cross
        left = 0
        U = 0
        for t in range(a, b):
            c = order[t]
            h = h_x[c] if width[c] > largest else h_in[c]
            if h > top:
                top = h
            left += width[c]
            if U == 0 or g_w[U - 1] != width[c]:
                g_w[U] = width[c]
                g_head[U] = t
                U += 1
            g_tail[U - 1] = t + 1
        pos = 0
        while left > 0:
            j = node_of[pos]
            space = first[j + 1] - pos
            pick = -1
            tail = False
            if pos == first[j]:
                for u in range(U):  # a node starts with the widest group wider than any node
                    if g_w[u] <= largest:
                        break
                    if g_head[u] < g_tail[u]:
                        pick = u
                        break
            if pick < 0:
                for u in range(U):  # the widest group that fits the node's free ranks
                    if g_w[u] <= space and g_head[u] < g_tail[u]:
                        pick = u
                        break
            if pick < 0:
                if (N - pos) - left >= space:  # the round's idle ranks allow leaving the rest idle
                    pos += space
                    continue
                best = np.inf
                for u in range(U):  # a group must cross: the one that raises the top least
                    if g_head[u] < g_tail[u]:
                        c = order[g_tail[u] - 1]
                        pen = 0.0 if g_w[u] > largest else max(0.0, h_x[c] - top)
                        if pen <= best:  # equal: the narrowest, leaving the next node the most room
                            best = pen
                            pick = u
                tail = True
            if tail:
                g_tail[pick] -= 1
                c = order[g_tail[pick]]
            else:
                c = order[g_head[pick]]
                g_head[pick] += 1
            out[c] = pos
            pos += width[c]
            left -= width[c]
    return 0


@kernel(I64_1D, I64_1D, I64_1D, I64_1D, I64_1D, I64, I64_1D)
def place_pow2(order, bounds, width, first, node_of, largest, out):
    """Aligned blocks placed widest first (module docstring); ``out[c]`` the first rank of column c, -1
    for every column of a round whose blocks found no slot.  Returns the rounds placed."""
    N = node_of.size
    busy = np.zeros(N, dtype=np.bool_)
    placed = 0
    for r in range(bounds.size - 1):
        a, b = bounds[r], bounds[r + 1]
        busy[:] = False
        ok = True
        for t in range(a, b):
            c = order[t]
            w = width[c]
            inside = -1
            any_slot = -1
            for s in range(0, N - w + 1, w):
                free = True
                for x in range(s, s + w):
                    if busy[x]:
                        free = False
                        break
                if not free:
                    continue
                if any_slot < 0:
                    any_slot = s
                if w > largest or node_of[s] == node_of[s + w - 1]:
                    inside = s
                    break
            s = inside if inside >= 0 else any_slot
            if s < 0:
                ok = False
                break
            for x in range(s, s + w):
                busy[x] = True
            out[c] = s
        if ok:
            placed += 1
        else:
            for t in range(a, b):
                out[order[t]] = -1
    return placed
