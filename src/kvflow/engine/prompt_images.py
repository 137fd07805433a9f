"""A prompt's images, the engine's side: vLLM's prompt dict `{"prompt": text with one "<image>" per
image, "multi_modal_data": {"image": bytes or a list of bytes}}` (PNG, JPEG, WEBP or GIF files),
processed as the checkpoint's preprocessor_config.json says (kvflow.model.image_processing), each
`<image>` expanded to the tokens its tiles become, each image hashed (the prefix cache's key for it).
The worker encodes them (kvflow.worker.multimodal).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvflow.core.request import PromptImage
from kvflow.model.arch_config import ArchConfig
from kvflow.model.image_processing import (
    Idefics3ImageConfig,
    ImageLimits,
    expand_image_placeholders,
    process_image,
)
from kvflow.model.models.idefics3_vision import Idefics3VisionSpec

MAX_IMAGES_PER_PROMPT = 8  # each is encoded on the engine's step: a bound on one request's encoder work


class PromptImages:
    def __init__(self, model_dir: str, arch: ArchConfig, limits: ImageLimits = ImageLimits()) -> None:
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            raise ValueError(f"{arch.architecture} reads images as its preprocessor_config.json says, and {path} "
                             "is missing")
        spec = Idefics3VisionSpec.from_hf(arch.hf)
        self.image_token_id = spec.image_token_id
        self.config = Idefics3ImageConfig.from_hf(json.loads(path.read_text()), spec.tokens_per_image)
        self.limits = limits

    def expand_ids(self, token_ids: list[int], data: object, encode) -> tuple[list[int], tuple[PromptImage, ...]]:
        """Token ids with one `<image>` token per image (a chat template's placeholder) → the ids
        with each expanded to its image's tokens (`encode`: text → ids, no special tokens added)."""
        places = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        processed, images = self._processed(data)
        if len(places) != len(processed):
            raise ValueError(f"prompt_token_ids: {len(places)} <image> tokens for {len(processed)} images; there must "
                             "be one per image")
        expanded, start = [], 0
        for place, image in zip(places, processed):
            expanded += token_ids[start:place] + encode(image.prompt)
            start = place + 1
        return expanded + token_ids[start:], images

    def expand(self, text: object, data: object) -> tuple[str, tuple[PromptImage, ...]]:
        """(the text with each `<image>` expanded, its images). ValueError naming the field for a
        prompt that is not text, data that is not image files, too many images or a placeholder
        count that does not match."""
        if not isinstance(text, str):
            raise ValueError("a prompt with multi_modal_data needs its text in 'prompt', one <image> per image")
        processed, images = self._processed(data)
        return expand_image_placeholders(text, processed), images

    def _processed(self, data: object) -> tuple[list, tuple[PromptImage, ...]]:
        files = [data] if isinstance(data, (bytes, bytearray)) else data
        if not isinstance(files, (list, tuple)) or not files or not all(isinstance(f, (bytes, bytearray)) for f in files):
            raise ValueError("multi_modal_data.image must be an image file's bytes or a list of them")
        if len(files) > MAX_IMAGES_PER_PROMPT:
            raise ValueError(f"multi_modal_data.image: at most {MAX_IMAGES_PER_PROMPT} images per prompt; got {len(files)}")
        processed = [process_image(bytes(f), self.config, self.limits) for f in files]
        return processed, tuple(PromptImage(hashlib.sha256(f).digest(), p.pixel_values, p.num_image_tokens)
                                for f, p in zip(files, processed))
