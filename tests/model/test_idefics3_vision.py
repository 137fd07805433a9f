"""Idefics3 / SmolVLM's image half against transformers, float32, on a tiny random checkpoint:
the encoder's rows equal `get_image_features`, the image processor's pixel values and prompt text
equal transformers' processor's, and kvflow's Llama fed those rows in place of the `<image>`
tokens gives transformers' logits. Bad images are refused with a message saying why."""

from __future__ import annotations

import io
import json
import struct
import threading
import zlib

import pytest
import torch
from PIL import Image, ImageOps
from tiny_vlm_models import (
    LONGEST_EDGE,
    TILE,
    TOKENS_PER_TILE,
    make_tiny_idefics3,
    png_bytes,
    tiny_image_processor,
    tiny_processor,
)

from kvflow.attention.backend import get_attention_backend
from kvflow.attention.metadata import AttentionMetadata
from kvflow.distributed.parallel_state import TensorParallel, tensor_parallel_scope
from kvflow.model.arch_config import ArchConfig
from kvflow.model.image_processing import (
    Idefics3ImageConfig,
    ImageLimits,
    expand_image_placeholders,
    process_image,
)
from kvflow.model.loader.hf import load_hf_dir
from kvflow.model.loader.weights import process_weights_after_loading
from kvflow.model.models.idefics3_vision import (
    Idefics3Checkpoint,
    Idefics3ImageEncoder,
    Idefics3VisionSpec,
    text_config,
)
from kvflow.model.registry import build_model

# (height, width, PNG mode): odd sizes, both orientations, one tile and several, every alpha path.
IMAGES = [(37, 53, "RGB"), (61, 29, "RGBA"), (20, 90, "L"), (33, 33, "P"), (7, 5, "RGB"), (96, 64, "RGBA")]


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    directory = tmp_path_factory.mktemp("idefics3")
    hf, tokenizer = make_tiny_idefics3(directory)
    return directory, hf, tokenizer


def _load(directory):
    """(kvflow's Llama, the image encoder), loaded through one pass over the checkpoint."""
    checkpoint = load_hf_dir(directory, load_tokenizer=False)
    split = Idefics3Checkpoint(checkpoint.weights)
    llama = build_model(ArchConfig.from_hf(text_config(checkpoint.hf_config)), get_attention_backend("torch_reference"))
    llama.load_weights(split.text_weights())
    encoder = Idefics3ImageEncoder(Idefics3VisionSpec.from_hf(checkpoint.hf_config)).eval()
    encoder.load_weights(split.vision_weights())
    for model in (llama, encoder):
        process_weights_after_loading(model)
    return llama, encoder


def _image_config(do_image_splitting=True, longest_edge=LONGEST_EDGE) -> Idefics3ImageConfig:
    processor = tiny_image_processor(do_image_splitting, longest_edge)
    return Idefics3ImageConfig.from_hf(processor.to_dict(), TOKENS_PER_TILE)


def _pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def test_encode_images_equals_transformers_image_features(tiny_vlm):
    directory, hf, _ = tiny_vlm
    _, encoder = _load(directory)
    pixel_values = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        ours = encoder.encode_images(pixel_values)
        theirs = hf.get_image_features(pixel_values[None]).pooler_output[0]
    assert ours.shape == (3, TOKENS_PER_TILE, hf.config.text_config.hidden_size)
    torch.testing.assert_close(ours.flatten(0, 1), theirs, atol=1e-4, rtol=0)


def test_padded_images_take_transformers_positions_and_attend_only_to_valid_patches(tiny_vlm):
    directory, hf, _ = tiny_vlm
    _, encoder = _load(directory)
    pixel_values, mask = torch.randn(2, 3, 32, 32), torch.zeros(2, 32, 32, dtype=torch.long)
    mask[0] = 1
    mask[1, :18, :27] = 1  # 5 × 7 of the 8 × 8 patches hold pixels, the last of each partly
    pixel_values[1] *= mask[1]
    with torch.no_grad():
        ours = encoder.encode_images(pixel_values, mask)
        theirs = hf.get_image_features(pixel_values[None], mask[None]).pooler_output[0]
        unmasked = encoder.encode_images(pixel_values)
    torch.testing.assert_close(ours.flatten(0, 1), theirs, atol=1e-4, rtol=0)
    assert not torch.allclose(ours[1], unmasked[1], atol=1e-3)  # the mask changed positions and attention
    torch.testing.assert_close(ours[0], unmasked[0], atol=1e-5, rtol=0)  # a full image is unchanged


# (splitting, longest edge): tiles of a 96-pixel image, one resized tile, and one 32-pixel tile unsplit.
PROCESSINGS = [(True, LONGEST_EDGE), (False, LONGEST_EDGE), (True, TILE)]


@pytest.mark.parametrize(("do_image_splitting", "longest_edge"), PROCESSINGS)
@pytest.mark.parametrize(("height", "width", "mode"), IMAGES)
def test_pixel_values_equal_transformers_image_processor(height, width, mode, do_image_splitting, longest_edge):
    data = png_bytes(height, width, mode, seed=height)
    ours = process_image(data, _image_config(do_image_splitting, longest_edge))
    processor = tiny_image_processor(do_image_splitting, longest_edge)
    theirs = processor(_pil(data), return_tensors="pt", return_row_col_info=True)
    assert torch.equal(ours.pixel_values, theirs["pixel_values"][0])
    assert (ours.rows, ours.cols) == (theirs["rows"][0][0], theirs["cols"][0][0])
    assert ours.num_image_tokens == TOKENS_PER_TILE * len(ours.pixel_values)


def test_a_jpeg_is_turned_upright_by_its_exif_orientation():
    stored = _pil(png_bytes(20, 50)).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to view
    data = _encoded(stored, "JPEG", quality=90, exif=exif.tobytes())
    upright = ImageOps.exif_transpose(_pil(data))
    assert upright.size == (20, 50)  # (width, height): the stored 50 × 20 turned
    ours = process_image(data, _image_config())
    theirs = tiny_image_processor()(upright, return_tensors="pt", return_row_col_info=True)
    assert torch.equal(ours.pixel_values, theirs["pixel_values"][0])
    assert (ours.rows, ours.cols) == (3, 2)  # tall: three rows of two tiles


@pytest.mark.parametrize(("do_image_splitting", "grids"), [(True, [(3, 2), (3, 3), (3, 2)]), (False, [(0, 0)] * 3)])
def test_prompt_equals_transformers_processor(do_image_splitting, grids, tiny_vlm):
    _, _, tokenizer = tiny_vlm
    pngs = [png_bytes(61, 29, "RGB"), png_bytes(20, 20, "RGB"), png_bytes(90, 40, "RGBA")]
    text = "User:<image>What differs from <image>? And<image>\nAssistant:"
    images = [process_image(data, _image_config(do_image_splitting)) for data in pngs]
    assert [(i.rows, i.cols) for i in images] == grids
    ours = expand_image_placeholders(text, images)
    processor = tiny_processor(tokenizer, do_image_splitting)
    theirs = processor(text=[text], images=[[_pil(d) for d in pngs]])["input_ids"][0]
    assert tokenizer.decode(theirs) == ours
    assert tokenizer(ours)["input_ids"] == theirs


def test_placeholders_must_match_the_images():
    image = process_image(png_bytes(20, 20), _image_config())
    with pytest.raises(ValueError, match="prompt: 2 <image> placeholders for 1 images"):
        expand_image_placeholders("<image> and <image>", [image])


def _prefill_logits(llama, embeds: torch.Tensor) -> torch.Tensor:
    """kvflow's Llama over one prompt given as input rows instead of token ids: its layers called
    as DecoderModel.forward calls them, after the embedding (the hook the engine needs)."""
    block, n = 16, embeds.shape[0]
    blocks = -(-n // block)
    meta = AttentionMetadata(torch.tensor([0, n]), torch.tensor([n]), torch.arange(blocks)[None], torch.arange(n),
                             block, [n], [n])
    cfg, decoder = llama.config, llama.model
    caches = [torch.zeros(2, blocks, cfg.num_kv_heads, block, cfg.head_dim) for _ in decoder.layers]
    rope, hidden, residual = decoder.rope_tables(torch.arange(n)), embeds, None
    for layer, cache in zip(decoder.layers, caches):
        hidden, residual = layer(rope, hidden, residual, cache, (meta,))
    normed, _ = decoder.norm(hidden, residual)
    return llama.compute_logits(normed)


@pytest.mark.parametrize("tied", [False, True])
def test_text_with_an_image_gives_transformers_logits(tied, tmp_path):
    hf, tokenizer = make_tiny_idefics3(tmp_path, seed=3, tie_word_embeddings=tied)
    llama, encoder = _load(tmp_path)
    assert (llama.lm_head is llama.model.embed_tokens) == tied
    data = png_bytes(45, 70, "RGB")
    image = process_image(data, _image_config())
    text = expand_image_placeholders("User: look<image> here.\nAssistant:", [image])
    ids = torch.tensor(tokenizer(text)["input_ids"])
    inputs = tiny_processor(tokenizer)(text=["User: look<image> here.\nAssistant:"], images=[[_pil(data)]],
                                       return_tensors="pt")
    assert torch.equal(inputs["input_ids"][0], ids)
    with torch.no_grad():
        theirs = hf(**inputs).logits[0]
        embeds = llama.model.embed(ids)
        image_rows = ids == hf.config.image_token_id
        embeds[image_rows] = encoder.encode_images(image.pixel_values).flatten(0, 1)
        ours = _prefill_logits(llama, embeds)
        text_only = _prefill_logits(llama, llama.model.embed(ids))
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert not torch.allclose(text_only[-1], theirs[-1], atol=1e-2)  # the image rows decide the answer


def _png_with_header_size(width: int, height: int) -> bytes:
    """A small RGB PNG whose header claims width × height (its pixel data is a few bytes)."""
    data = bytearray(png_bytes(4, 4))
    ihdr = struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return bytes(data)


def _encoded(image: Image.Image, fmt: str, **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **kwargs)
    return out.getvalue()


def _animated_gif() -> bytes:
    frames = [Image.new("RGB", (8, 8), color) for color in ("red", "blue")]
    return _encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])


BAD_IMAGES = {
    "not an image": (b"definitely not an image", ImageLimits(), "not a valid image in a supported format"),
    "format not allowed": (_encoded(Image.new("RGB", (8, 8)), "BMP"), ImageLimits(), r"supported format \(PNG, JPEG"),
    "truncated": (png_bytes(40, 40)[:300], ImageLimits(), "PNG data is truncated or corrupt"),
    "zero width": (_png_with_header_size(0, 10), ImageLimits(), "not a valid image in a supported format"),
    "bomb by header": (_png_with_header_size(5000, 5000), ImageLimits(),
                       "5000 × 5000 pixels is more than the limit of 16777216"),
    "huge by header": (_png_with_header_size(60000, 60000), ImageLimits(), "image: too large"),
    "corrupt header": (png_bytes(8, 8)[:20], ImageLimits(), "image: cannot read its header"),
    "over max_pixels": (png_bytes(20, 30), ImageLimits(max_pixels=500), "30 × 20 pixels is more than the limit of 500"),
    "animated": (_animated_gif(), ImageLimits(), "animated GIF images are not supported"),
    "too many tiles": (png_bytes(90, 90), ImageLimits(max_tiles=4), "3 × 3 tiles, more than the limit of 4"),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_bad_images_are_refused_with_the_reason(case):
    data, limits, message = BAD_IMAGES[case]
    with pytest.raises(ValueError, match=message):
        process_image(data, _image_config(), limits)


def test_encode_images_refuses_shapes_it_cannot_encode(tiny_vlm):
    directory, _, _ = tiny_vlm
    _, encoder = _load(directory)
    with pytest.raises(ValueError, match=r"pixel_values must be \[N, 3, H, H\] \(square images\); got \(1, 3, 32, 40\)"):
        encoder.encode_images(torch.zeros(1, 3, 32, 40))
    with pytest.raises(ValueError, match="pixel_values: side 36 must be a multiple of patch_size 4 × scale_factor 2"):
        encoder.encode_images(torch.zeros(1, 3, 36, 36))
    with pytest.raises(ValueError, match=r"pixel_attention_mask: images \[1\] have no valid pixel"):
        encoder.encode_images(torch.zeros(2, 3, 32, 32), torch.zeros(2, 32, 32).index_fill_(0, torch.tensor([0]), 1))


def test_checkpoint_split_and_config_errors_name_what_is_wrong(tiny_vlm):
    directory, _, _ = tiny_vlm
    split = Idefics3Checkpoint([("model.vision_model.post_layernorm.weight", torch.ones(1)),
                                ("model.text_model.norm.weight", torch.ones(1)), ("lm_head.weight", torch.ones(1))])
    with pytest.raises(RuntimeError, match="load the text model from text_weights"):
        split.vision_weights()
    assert [n for n, _ in split.text_weights()] == ["model.norm.weight", "lm_head.weight"]
    assert [n for n, _ in split.vision_weights()] == ["vision_model.post_layernorm.weight"]
    stray = Idefics3Checkpoint([("model.perceiver.weight", torch.ones(1))])
    with pytest.raises(ValueError, match="'model.perceiver.weight' belongs to no part of an Idefics3 model"):
        list(stray.text_weights())
    config = json.loads((directory / "config.json").read_text())
    assert Idefics3VisionSpec.from_hf(config).tokens_per_image == TOKENS_PER_TILE
    with pytest.raises(ValueError, match="image_size 36 must be a multiple of patch_size 4 × scale_factor 2"):
        Idefics3VisionSpec.from_hf({**config, "vision_config": {**config["vision_config"], "image_size": 36}})
    with pytest.raises(ValueError, match="hidden_size 32 does not split into 5 attention heads"):
        Idefics3VisionSpec.from_hf({**config, "vision_config": {**config["vision_config"], "num_attention_heads": 5}})
    with pytest.raises(ValueError, match="vision_config.hidden_act 'gelu' is not supported"):
        Idefics3VisionSpec.from_hf({**config, "vision_config": {**config["vision_config"], "hidden_act": "gelu"}})
    with pytest.raises(ValueError, match="text_config.model_type 'mistral' is not supported"):
        text_config({**config, "text_config": {**config["text_config"], "model_type": "mistral"}})


class _ThreadRanks:
    """A stand-in process group for ranks run as threads of this process: each all-reduce waits
    for every rank's tensor and gives each their sum (the collective the row-parallel layers call)."""

    def __init__(self, size: int) -> None:
        self.barrier, self.parts = threading.Barrier(size, timeout=30), [None] * size  # a failed rank breaks it

    def rank(self, rank: int):
        ranks = self

        class Group:
            def allreduce(self, tensors):
                ranks.parts[rank] = tensors[0].clone()
                ranks.barrier.wait()
                tensors[0].copy_(sum(ranks.parts))
                ranks.barrier.wait()  # nobody overwrites a part before every rank summed
                return self

            def wait(self):
                return None

        return Group()


def test_two_tensor_parallel_ranks_encode_as_one(tiny_vlm):
    directory, _, _ = tiny_vlm
    _, whole = _load(directory)
    ranks, encoders = _ThreadRanks(2), []
    for rank in range(2):
        with tensor_parallel_scope(TensorParallel(rank, 2, ranks.rank(rank))):
            encoder = Idefics3ImageEncoder(whole.spec).eval()
        split = Idefics3Checkpoint(load_hf_dir(directory, load_tokenizer=False).weights)
        list(split.text_weights())
        encoder.load_weights(split.vision_weights())
        encoders.append(encoder)
    qkv = [e.vision_model.encoder.layers[0].self_attn.qkv_proj for e in encoders]
    assert [q.weight.shape[0] for q in qkv] == [3 * 16, 3 * 16]  # two of the four heads each, of q, k and v
    pixel_values, outputs = torch.randn(2, 3, 32, 32), [None, None]

    def run(rank):
        with torch.no_grad():
            outputs[rank] = encoders[rank].encode_images(pixel_values)

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    with torch.no_grad():
        expected = whole.encode_images(pixel_values)
    for output in outputs:
        torch.testing.assert_close(output, expected, atol=1e-5, rtol=0)
