"""Per-request block tables on top of the block pool.

A request owns an ordered list of block ids; token position p lives in slot
`block_ids[p // block_size] * block_size + p % block_size`. Blocks are added as the request's
computed tokens grow and all go back to the pool when it finishes, is aborted or is preempted.
"""

from __future__ import annotations

from kvflow.core.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return self._block_tables.get(request_id, [])

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Make room for the request's first `num_tokens` tokens; False (and no change) if the
        pool cannot provide the missing blocks."""
        table = self._block_tables.setdefault(request_id, [])
        missing = self.blocks_needed(num_tokens) - len(table)
        if missing <= 0:
            return True
        if missing > self.pool.num_free_blocks:
            if not table:
                del self._block_tables[request_id]
            return False
        table.extend(self.pool.allocate(missing))
        return True

    def free(self, request_id: str) -> None:
        table = self._block_tables.pop(request_id, None)
        if table:
            # Reversed, so a request's tail blocks (least likely to be shared later) are reused first.
            self.pool.release(table[::-1])
