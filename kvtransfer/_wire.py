"""The wire format of a KV transfer between a prefill worker (P) and a decode worker (D), in order on their pair:

1. header int64[HEADER_LEN] P->D: MAGIC, transfer id, page count, token count, first token, then the payload's
   layout (layers, page size, entry dim, bytes per value) and its piece size in layers;
2. the pages P->D, page-contiguous, cut along the layer axis into pieces (`chunk_plan`): piece [l0, l1) is
   the tensor [l1 - l0, num_pages, page_size, dim] of those layers of the pages, in the request's page order;
3. ack int64[2] D->P: transfer id, ACK_OK or ACK_DISCARDED.
"""

from __future__ import annotations

MAGIC = 0x4B565846  # "KVXF"
HEADER_LEN = 10
TAG_HEADER, TAG_PAGES, TAG_ACK = 0, 1, 2
ACK_OK, ACK_DISCARDED = 1, 2
_RAMP = 4


def chunk_plan(num_layers: int, chunk_layers: int) -> list[tuple[int, int]]:
    """The layer ranges [start, stop) a transfer is cut into, in wire order; both sides derive it from the header.

    One piece when `chunk_layers` covers all layers. Otherwise the pieces ramp up from one layer by a factor of
    `_RAMP` and back down to one at the end, with pieces of at most `chunk_layers` in between: P gathers piece i + 1
    while piece i is on the wire and D scatters piece i while piece i + 1 is, and a gather or scatter moves a layer
    about five times faster than the link (benchmarks/RESULTS.md), so each piece hides the copy of a neighbour
    `_RAMP` times its size, and only one layer's gather and one layer's scatter are left in the open."""
    if chunk_layers >= num_layers or num_layers <= 2:
        return [(0, num_layers)]
    ramp: list[int] = []
    size = 1
    while size < chunk_layers and 2 * (sum(ramp) + size) <= num_layers:
        ramp.append(size)
        size *= _RAMP
    middle = num_layers - 2 * sum(ramp)
    count = -(-middle // chunk_layers)
    sizes = ramp + [middle // count + (i < middle % count) for i in range(count)] + ramp[::-1]
    bounds = [0]
    for size in sizes:
        if size:
            bounds.append(bounds[-1] + size)
    return list(zip(bounds[:-1], bounds[1:], strict=False))
