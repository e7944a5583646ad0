"""A binary min-heap of indices ordered by (key, index), in a preallocated array (compiled)."""

from hdp.packing.kernels.jit import helper

__all__ = ["heap_push", "heap_pop"]


@helper
def _below(key, a, b):
    """Entry a sorts before entry b: by ``key``, then index."""
    return key[a] < key[b] or (key[a] == key[b] and a < b)


@helper
def heap_push(heap, size, key, b):
    """Bin b into the binary min-heap ``heap[:size]`` ordered by (``key``, index); returns the new size."""
    j = size
    heap[j] = b
    while j > 0:
        up = (j - 1) >> 1
        if not _below(key, heap[j], heap[up]):
            break
        heap[j], heap[up] = heap[up], heap[j]
        j = up
    return size + 1


@helper
def heap_pop(heap, size, key):
    """The first bin of the min-heap ``heap[:size]`` (by ``key``, then index) taken out; the new size is
    ``size - 1``.  A bin's key must not change while it is in the heap."""
    top = heap[0]
    size -= 1
    heap[0] = heap[size]
    j = 0
    while True:
        c = 2 * j + 1
        if c >= size:
            break
        if c + 1 < size and _below(key, heap[c + 1], heap[c]):
            c += 1
        if not _below(key, heap[c], heap[j]):
            break
        heap[j], heap[c] = heap[c], heap[j]
        j = c
    return top
