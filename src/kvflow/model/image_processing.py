"""Images from clients into what Idefics3 / SmolVLM read: pixel values of square tiles, and the
text that stands for them in the prompt. The same numbers transformers' Idefics3ImageProcessor
(its PIL backend) and the same string its Idefics3Processor produce.

The bytes are untrusted (an OpenAI `image_url` content part), so they are decoded defensively:
only the formats in `ImageLimits.formats`, the size read from the header and refused past
`max_pixels` before any pixel is decoded (a small PNG may declare a gigapixel image), animated
images refused, and every decoder failure (not an image, truncated, corrupt) a ValueError that
says what is wrong. The EXIF orientation is applied (a phone photo is upright, as transformers'
`load_image` makes it), and transparency is composited onto white, as the image processor does.

Then, as Idefics3's processor does, all in 8-bit RGB through Pillow's resampling:

1. the longest edge is resized to `longest_edge` (up or down), the other in proportion (rounded
   up to even), never beyond 4096;
2. with splitting, both edges are resized up to multiples of `tile_size` and the image is cut
   into rows × cols tiles, then the whole image resized to one tile is appended (the "global"
   image; an image that is one tile is only that); without, the image is resized to one tile;
3. each tile is rescaled to [0, 1] (float64, then float32) and normalized by mean and std.

Tiles are always tile_size × tile_size, so the tiles of any images stack without padding and
need no pixel mask.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

# transformers' Idefics3ImageProcessor defaults, for keys a preprocessor_config.json leaves out.
PROCESSOR_DEFAULTS: Mapping = MappingProxyType(dict(
    size={"longest_edge": 4 * 364}, max_image_size={"longest_edge": 364}, do_image_splitting=True,
    resample=Image.Resampling.LANCZOS, rescale_factor=1 / 255, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5)))
# Steps kvflow always takes; a config that turns one off is refused rather than silently differing.
REQUIRED_STEPS = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
MAX_EDGE = 4096  # transformers' bound on a resized image's edge (MAX_IMAGE_SIZE)
MAX_GRID = 6  # the tokenizer has <row_r_col_c> tokens for r, c <= 6


@dataclass(frozen=True)
class ImageLimits:
    """What one client image may cost. `max_pixels` (width × height, checked from the header
    before decoding) bounds decode memory and time: 4096² by default, room for a 12-megapixel
    photo, 48 MiB decoded. `max_tiles` bounds the encoder's work per image (each tile is one
    vision-transformer pass; the global image is not counted): 16 by default, what SmolVLM's
    and Idefics3's own configs can produce, so it refuses nothing they make unless lowered."""

    max_pixels: int = 4096 * 4096
    max_tiles: int = 16
    formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF")


@dataclass(frozen=True)
class Idefics3ImageConfig:
    """A checkpoint's preprocessor_config.json, and the tokens per tile its model makes."""

    longest_edge: int  # size["longest_edge"]
    tile_size: int  # max_image_size["longest_edge"]: the vision encoder's input side
    do_image_splitting: bool
    resample: Image.Resampling
    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    tokens_per_tile: int  # `<image>` tokens per tile: Idefics3VisionSpec.tokens_per_image

    @classmethod
    def from_hf(cls, preprocessor_config: Mapping, tokens_per_tile: int) -> Idefics3ImageConfig:
        cfg = {**PROCESSOR_DEFAULTS, **{k: v for k, v in preprocessor_config.items() if v is not None}}
        off = [step for step in REQUIRED_STEPS if cfg.get(step, True) is False]
        if off:
            raise ValueError(f"preprocessor_config.json: {', '.join(off)} false is not supported")
        config = cls(int(cfg["size"]["longest_edge"]), int(cfg["max_image_size"]["longest_edge"]),
                     bool(cfg["do_image_splitting"]), Image.Resampling(cfg["resample"]), float(cfg["rescale_factor"]),
                     tuple(map(float, cfg["image_mean"])), tuple(map(float, cfg["image_std"])), int(tokens_per_tile))
        if config.do_image_splitting and math.ceil(min(config.longest_edge, MAX_EDGE) / config.tile_size) > MAX_GRID:
            raise ValueError(f"preprocessor_config.json: size.longest_edge {config.longest_edge} over "
                             f"max_image_size.longest_edge {config.tile_size} makes more than {MAX_GRID} tile rows, "
                             "beyond the tokenizer's <row_r_col_c> tokens")
        return config


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: torch.Tensor  # [tiles, 3, tile_size, tile_size] float32: rows × cols tiles row by row, then the global
    rows: int  # 0 and 0: not split (one tile, the global image)
    cols: int
    prompt: str  # what stands for the image in the prompt text

    @property
    def num_image_tokens(self) -> int:
        """`<image>` tokens in `prompt`: rows of encoder output the prompt takes."""
        return self.prompt.count("<image>")


def process_image(data: bytes, config: Idefics3ImageConfig, limits: ImageLimits = ImageLimits()) -> ProcessedImage:
    """Image file bytes → tiles and prompt text; a ValueError naming the problem for bad images."""
    image = resize_longest_edge(decode_image(data, limits), config)
    rows, cols = tile_grid(image.height, image.width, config)
    if rows * cols > limits.max_tiles:
        raise ValueError(f"image: it would be split into {rows} × {cols} tiles, more than the limit of "
                         f"{limits.max_tiles}")
    tiles = split_into_tiles(image, rows, cols, config)
    pixel_values = torch.from_numpy(np.stack([normalized(tile, config) for tile in tiles]))
    if rows * cols == 1:  # an image of one tile is not split: its global image is all
        rows = cols = 0
    return ProcessedImage(pixel_values, rows, cols, image_prompt(rows, cols, config.tokens_per_tile))


def decode_image(data: bytes, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """8-bit RGB, upright, transparency on white; refused past the limits before decoding."""
    try:
        image = Image.open(io.BytesIO(data), formats=limits.formats)
    except UnidentifiedImageError:
        raise ValueError(f"image: the data is not a valid image in a supported format "
                         f"({', '.join(limits.formats)})") from None
    except Image.DecompressionBombError as e:
        raise ValueError(f"image: too large ({e})") from None
    except Exception as e:  # crafted headers make Pillow raise many kinds (struct.error, IndexError, ...)
        raise ValueError(f"image: cannot read its header ({type(e).__name__}: {e})") from None
    width, height = image.size
    if width < 1 or height < 1:  # Pillow's plugins refuse these today; resizing would divide by zero
        raise ValueError(f"image: its size is {width} × {height} pixels; it must be at least 1 × 1")
    if width * height > limits.max_pixels:
        raise ValueError(f"image: {width} × {height} pixels is more than the limit of {limits.max_pixels}")
    if getattr(image, "is_animated", False):
        raise ValueError(f"image: animated {image.format} images are not supported")
    try:
        image.load()
        return to_rgb(ImageOps.exif_transpose(image))
    except Exception as e:  # as above, for the pixel data and its EXIF block
        raise ValueError(f"image: the {image.format} data is truncated or corrupt ({type(e).__name__}: {e})") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (what the image processor does)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def resize_longest_edge(image: Image.Image, config: Idefics3ImageConfig) -> Image.Image:
    """Step 1: the longest edge to `longest_edge`, the other in proportion, rounded up to even."""
    height, width = image.height, image.width
    aspect = width / height
    if width >= height:
        width = config.longest_edge
        height = int(width / aspect)
        height += height % 2
    else:
        height = config.longest_edge
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height  # of the rounded size, as transformers takes it
    if width >= height and width > MAX_EDGE:
        width, height = MAX_EDGE, max(int(MAX_EDGE / aspect), 1)
    elif height > width and height > MAX_EDGE:
        height, width = MAX_EDGE, max(int(MAX_EDGE * aspect), 1)
    return image.resize((width, height), config.resample)


def tile_grid(height: int, width: int, config: Idefics3ImageConfig) -> tuple[int, int]:
    """(rows, cols) of tiles a resized image is cut into: 1 × 1 without splitting."""
    if not config.do_image_splitting:
        return 1, 1
    height, width = _tile_multiple_size(height, width, config.tile_size)
    return height // config.tile_size, width // config.tile_size


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    # The longer edge rounds up to a multiple of the tile; the shorter follows the aspect ratio
    # from there and then rounds up too (transformers' order of operations, kept for equal sizes).
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def split_into_tiles(image: Image.Image, rows: int, cols: int, config: Idefics3ImageConfig) -> list[Image.Image]:
    """Step 2: rows × cols tiles row by row, then the global image (only it for 1 × 1)."""
    t = config.tile_size
    if rows * cols == 1:
        return [image.resize((t, t), config.resample)]
    image = image.resize((cols * t, rows * t), config.resample)
    tiles = [image.crop((c * t, r * t, (c + 1) * t, (r + 1) * t)) for r in range(rows) for c in range(cols)]
    return tiles + [image.resize((t, t), config.resample)]


def normalized(tile: Image.Image, config: Idefics3ImageConfig) -> np.ndarray:
    """Step 3: [3, t, t] float32, (pixel × rescale_factor − mean) / std, in transformers' precisions."""
    pixels = (np.asarray(tile).astype(np.float64) * config.rescale_factor).astype(np.float32)
    mean, std = np.array(config.image_mean, np.float32), np.array(config.image_std, np.float32)
    return ((pixels - mean) / std).transpose(2, 0, 1)


def image_prompt(rows: int, cols: int, tokens_per_tile: int) -> str:
    """The text for one image: each tile's `<fake_token_around_image><row_r_col_c>` and its
    `<image>` tokens, a newline after each row, then a blank line and the global image between
    two `<fake_token_around_image>`s (an image not split is only the last part)."""
    image_tokens = "<image>" * tokens_per_tile
    global_image = f"<fake_token_around_image><global-img>{image_tokens}<fake_token_around_image>"
    if rows == cols == 0:
        return global_image
    grid = "".join("".join(f"<fake_token_around_image><row_{r}_col_{c}>{image_tokens}" for c in range(1, cols + 1))
                   + "\n" for r in range(1, rows + 1))
    return f"{grid}\n{global_image}"


def expand_image_placeholders(text: str, images: Sequence[ProcessedImage], placeholder: str = "<image>") -> str:
    """`text` with its i-th `placeholder` replaced by image i's prompt; as many placeholders as
    images, or a ValueError saying how many of each there are."""
    parts = text.split(placeholder)
    if len(parts) - 1 != len(images):
        raise ValueError(f"prompt: {len(parts) - 1} {placeholder} placeholders for {len(images)} images; "
                         "there must be one per image")
    return "".join(part + image.prompt for part, image in zip(parts, images)) + parts[-1]
