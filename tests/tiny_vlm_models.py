"""A tiny random Idefics3 (SmolVLM's architecture) checkpoint, with the tokenizer and the
transformers processor that go with it, written at test time.

Tiles of 32×32 pixels, 4×4 patches: an 8×8 grid that pixel shuffle (scale 2) makes 16 `<image>`
tokens per tile. Images are resized so their longest edge is 96 pixels, so a split image is at
most 3×3 tiles plus the global one.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

TILE, LONGEST_EDGE, TOKENS_PER_TILE = 32, 96, 16
IMAGE_SPECIAL_TOKENS = (["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
                        + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])


def write_vlm_tokenizer(directory: Path):
    """A character-level tokenizer (printable ASCII and newline) with Idefics3's image tokens as
    special tokens; returns it as a transformers tokenizer."""
    import tokenizers
    from tokenizers import decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    backend = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    backend.add_special_tokens(IMAGE_SPECIAL_TOKENS)
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.save_pretrained(directory)
    return tokenizer


def tiny_image_processor(do_image_splitting: bool = True, longest_edge: int = LONGEST_EDGE):
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    return Idefics3ImageProcessorPil(do_image_splitting=do_image_splitting, max_image_size={"longest_edge": TILE},
                                     size={"longest_edge": longest_edge})


def tiny_processor(tokenizer, do_image_splitting: bool = True):
    from transformers import Idefics3Processor

    return Idefics3Processor(tiny_image_processor(do_image_splitting), tokenizer, image_seq_len=TOKENS_PER_TILE)


def make_tiny_idefics3(directory: Path, seed: int = 0, tie_word_embeddings: bool = False):
    """Write the checkpoint and tokenizer to `directory`; return (transformers model float32 with
    eager attention, tokenizer)."""
    import transformers

    tokenizer = write_vlm_tokenizer(directory)
    config = transformers.Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           image_size=TILE, patch_size=4, initializer_range=0.2),
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                         max_position_embeddings=2048, initializer_range=0.3, tie_word_embeddings=tie_word_embeddings),
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(config).float().eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():  # HF zero-inits biases and sets norms to 1; random ones make those paths matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    return model, tokenizer


def png_bytes(height: int, width: int, mode: str = "RGB", seed: int = 0) -> bytes:
    """A PNG of smooth gradients plus noise (resampling sees both edges and texture) in `mode`
    (RGB, RGBA with varying alpha, L, or P with a transparent palette entry)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    rgb = np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(rgb, "RGB")
    if mode == "RGBA":
        image.putalpha(Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L"))
    elif mode == "P":
        image = image.quantize(16)
        image.info["transparency"] = 3
    elif mode != "RGB":
        image = image.convert(mode)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
