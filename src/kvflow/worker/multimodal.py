"""Images in the prompt, the runner's side: each image encoded once, when a chunk first holds its
`<image>` tokens, and kept by its hash (the newest MAX_CACHED_IMAGES: a prompt sent again, or its
other chunks, reuse the rows); a step's `<image>` rows spliced into its input rows.

The k-th `<image>` token of a prompt takes the k-th row of its images' rows in order (the engine
expanded each image to exactly its rows' count of tokens), so a chunk that starts inside an image
takes that image's later rows only, and chunked prefill needs no image boundary.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from kvflow.core.request import PromptImage
from kvflow.core.sched_output import ScheduledChunk

MAX_CACHED_IMAGES = 64  # images whose encoder rows stay in memory, newest first


class ImageRows:
    """The model's encoder (`encode_images`, `image_token_id`) behind a cache by image hash."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.image_token_id = model.image_token_id
        self.cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def inputs_embeds(self, chunks: list[ScheduledChunk], input_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's first-layer input rows with every `<image>` row replaced, or None when no
        chunk holds an image token (the model embeds the tokens itself)."""
        rows, values, offset = [], [], 0
        for chunk in chunks:
            found = self._chunk_rows(chunk) if chunk.images else None
            if found is not None:
                rows.extend(offset + r for r in found[0])
                values.append(found[1])
            offset += chunk.num_tokens
        if not rows:
            return None
        embeds = self.model.model.embed(input_ids)
        embeds[torch.tensor(rows, device=embeds.device)] = torch.cat(values).to(embeds.device, embeds.dtype)
        return embeds

    def _chunk_rows(self, chunk: ScheduledChunk) -> tuple[list[int], torch.Tensor] | None:
        """(rows of the chunk that are `<image>` tokens, their encoder rows), or None."""
        prompt, start = chunk.prompt_token_ids, chunk.start_pos
        end = min(start + chunk.num_tokens - chunk.num_spec_tokens, len(prompt))
        if start >= end:
            return None
        positions = np.flatnonzero(np.asarray(prompt[:end]) == self.image_token_id)
        first = int(np.searchsorted(positions, start))
        if first == len(positions):
            return None
        encoded = torch.cat([self._encoded(image) for image in chunk.images])
        return (positions[first:] - start).tolist(), encoded[first:len(positions)]

    def _encoded(self, image: PromptImage) -> torch.Tensor:
        rows = self.cache.get(image.hash)
        if rows is None:
            rows = self.model.encode_images(image.pixel_values)
            if rows.shape[0] != image.num_tokens:
                raise ValueError(f"an image encoded to {rows.shape[0]} rows stands for {image.num_tokens} "
                                 "<image> tokens in its prompt")
            self.cache[image.hash] = rows
            while len(self.cache) > MAX_CACHED_IMAGES:
                self.cache.popitem(last=False)
        self.cache.move_to_end(image.hash)
        return rows
