"""Content hashes of full KV blocks, chained: a block's hash covers its tokens, its parent's
hash and any extra keys (LoRA adapter, cache salt), so equal hashes mean equal prefixes.

SHA-256 makes an accidental collision, which would silently serve another prompt's KV,
practically impossible.
"""

from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes
ROOT_HASH: BlockHash = b""


def hash_block(parent: BlockHash, token_ids: list[int], extra_keys: tuple = ()) -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def cache_extra_keys(cache_salt: str | None, lora_int_id: int, image_hashes: tuple[bytes, ...] = ()) -> tuple:
    """What besides its tokens keys a prompt's first block: requests share cached blocks only with
    the same salt, the same LoRA adapter (0: none) and the same images (their `<image>` tokens are
    alike whatever the pixels, so the images key the whole prompt, from its first block on)."""
    salt = () if cache_salt is None else (cache_salt,)
    keys = salt if not lora_int_id else (*salt, ("lora", lora_int_id))
    return keys if not image_hashes else (*keys, ("images", *image_hashes))


def extend_block_hashes(hashes: list[BlockHash], token_ids: list[int], block_size: int, extra_keys: tuple = ()) -> None:
    """Append the hashes of every full block of `token_ids` not yet in `hashes`. Extra keys enter
    the first block only; the chain carries them to every later one."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        if hashes:
            hashes.append(hash_block(hashes[-1], token_ids[start:start + block_size]))
        else:
            hashes.append(hash_block(ROOT_HASH, token_ids[start:start + block_size], extra_keys))
