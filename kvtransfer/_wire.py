"""The wire format of a KV transfer between a prefill worker (P) and a decode worker (D), in order on their pair:

1. header int64[HEADER_LEN] P->D: MAGIC, transfer id, page count, token count, first token, then the payload's
   layout (layers, page size, entry dim, bytes per value) and how it is cut: the largest piece and the first
   piece, in pages (`chunk_plan`), or CUT_AT_RECEIVER_RUNS and the number of pieces: one piece per run of D's
   pages for the transfer, as D advised (`pieces_at` D's `run_breaks`); last, the metadata's length in bytes
   (0 to `MAX_METADATA_BYTES`);
2. the metadata P->D, uint8[length], only when the length is not 0: the bytes P passed to `send`, which D
   returns with the transfer's result (opaque here: what the prefill worker knows of the request beyond its KV);
3. the pages P->D, cut along the page axis into pieces (`chunk_plan`): piece [a, b) is the tensor
   [b - a, num_layers, page_size, dim] of the request's pages a .. b - 1 (in the request's page order), all layers
   of a page together (the page-major cache's layout);
4. ack int64[2] D->P: transfer id, ACK_OK or ACK_DISCARDED.

Each side reads or writes a piece in place when its own pages for the piece are one run of consecutive ids, and
through a packed copy otherwise; neither needs to know what the other does.
"""

from __future__ import annotations

MAGIC = 0x4B56584D  # "KVXM": page-major, with metadata (before it: "KVXP"; layer-major: "KVXF")
HEADER_LEN = 12
TAG_HEADER, TAG_PAGES, TAG_ACK, TAG_METADATA = 0, 1, 2, 3
ACK_OK, ACK_DISCARDED = 1, 2
_RAMP = 4
CUT_AT_RECEIVER_RUNS = 0
"""In the header's largest-piece field: the pieces end where D's pages break runs."""


def pieces_at(cuts: list[int] | tuple[int, ...], total: int) -> list[tuple[int, int]]:
    """The pieces [start, stop) of `total` pages cut at `cuts` (increasing, inside (0, total))."""
    bounds = [0, *cuts, total]
    return list(zip(bounds[:-1], bounds[1:], strict=False))


def chunk_plan(total: int, largest: int, first: int) -> list[tuple[int, int]]:
    """The ranges [start, stop) of pages a transfer of `total` pages is cut into, in wire order; both sides
    derive it from the header.

    One piece when `largest` covers them all. Otherwise the pieces ramp up from `first` pages by a factor of
    `_RAMP` and back down to `first` at the end, with pieces of at most `largest` in between: P packs piece
    i + 1 while piece i is on the wire and D unpacks piece i while piece i + 1 is, so each piece hides the copy
    of a neighbour `_RAMP` times its size, and only the first piece's packing and the last one's unpacking are
    left in the open."""
    first = max(1, min(first, largest))
    if largest >= total or total <= 2 * first:
        return [(0, total)]
    ramp: list[int] = []
    size = first
    while size < largest and 2 * (sum(ramp) + size) <= total:
        ramp.append(size)
        size *= _RAMP
    middle = total - 2 * sum(ramp)
    count = -(-middle // largest)
    sizes = ramp + [middle // count + (i < middle % count) for i in range(count)] + ramp[::-1]
    bounds = [0]
    for size in sizes:
        if size:
            bounds.append(bounds[-1] + size)
    return pieces_at(bounds[1:-1], total)
