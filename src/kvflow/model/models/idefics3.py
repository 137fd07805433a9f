"""Idefics3 / SmolVLM: images in the prompt. A Llama reads the prompt; each image, cut into tiles
by the image processor (kvflow.model.image_processing), is encoded once by the vision tower and
connector (kvflow.model.models.idefics3_vision) into one row per `<image>` token, and those rows
replace the `<image>` tokens' embeddings at the first layer's input (LLaVA's recipe).

The runner splices: it asks `encode_images` for a request's images when a chunk first holds their
tokens (kept by image hash: worker.multimodal), and passes the step's input rows as
`inputs_embeds`. The language model is kvflow's Llama as it is, with its KV cache and kernels.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvflow.attention.backend import AttentionBackend
from kvflow.model.arch_config import ArchConfig
from kvflow.model.models.idefics3_vision import Idefics3Checkpoint, Idefics3ImageEncoder, Idefics3VisionSpec
from kvflow.model.models.llama import LlamaForCausalLM
from kvflow.quant.base import QuantizationConfig


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(cfg, backend, quant_config)
        self.vision_spec = Idefics3VisionSpec.from_hf(cfg.hf)
        self.vision = Idefics3ImageEncoder(self.vision_spec, quant_config)

    @property
    def image_token_id(self) -> int:
        return self.vision_spec.image_token_id

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image's tiles [tiles, 3, side, side] → its `<image>` rows [tiles × tokens per tile, hidden]."""
        return self.vision.encode_images(pixel_values).flatten(0, 1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One pass: the language model's tensors as they stream, then the vision tower's, which the
        checkpoint's split kept aside (q, k and v stack as the Llama's do)."""
        checkpoint = Idefics3Checkpoint(weights)

        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            yield from checkpoint.text_weights()
            yield from ((f"vision.{name}", tensor) for name, tensor in checkpoint.vision_weights())
        super().load_weights(renamed())
