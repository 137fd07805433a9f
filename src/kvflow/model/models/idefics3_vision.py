"""Idefics3's image encoder (SmolVLM's too: the same architecture): a SigLIP-style vision
transformer and the connector that turns its patches into rows of the language model's input.

One image tile (pixel_values [3, H, W], H = W) is cut into (H / patch)² patches; a stride-patch
convolution embeds each, a learned position embedding is added, and pre-norm encoder layers
(bidirectional attention, a GeLU MLP) and a final LayerNorm follow. The connector then folds each
scale × scale block of neighbouring patches into one vector (pixel shuffle: the image becomes
scale² times fewer, scale² times wider tokens) and projects it to the text model's hidden size.
`encode_images` returns one row of text-model input per `<image>` token of the prompt.

Images smaller than the grid the position embedding was trained on (a patch mask with fewer valid
rows or columns) take the position of the trained grid cell each patch falls in, as Idefics3 does:
a patch's row i of n valid rows maps to cell ⌊i / n × side⌋. The image processor
(`kvflow.model.image_processing`) only ever makes full square tiles, so there every position is
its own cell; the mask is for callers that pad.

Every projection is a layer of the linear seam (q/k/v as one `QKVParallelLinear`, out_proj and
fc2 row-parallel, fc1 column-parallel, the connector's projection replicated), so quantization and
tensor parallelism apply as to the text model; the patch convolution, position table and norms
are small and stay plain torch modules.

The checkpoint's tensors: `model.vision_model.*` and `model.connector.*` are this module's (less
the `model.` prefix), `model.text_model.*` and `lm_head.weight` the Llama's (`Idefics3Checkpoint`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from kvflow.model.loader.weights import load_named_weights
from kvflow.quant.base import QuantizationConfig

# What transformers' Idefics3VisionConfig / Idefics3Config assume when config.json leaves a field out.
VISION_DEFAULTS: Mapping = MappingProxyType(dict(
    hidden_size=1152, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16, num_channels=3,
    image_size=224, patch_size=32, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6))
CONNECTOR_DEFAULTS: Mapping = MappingProxyType(dict(scale_factor=2, image_token_id=128257))

# The checkpoint keeps q, k and v apart; they run as one matmul.
VISION_STACKED_PARAMS: Mapping = MappingProxyType({"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                                                     "v_proj": ("qkv_proj", "v")})


@dataclass(frozen=True)
class Idefics3VisionSpec:
    """The vision tower and connector of an Idefics3 config.json, with transformers' defaults."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int  # the side of the square the position embedding covers
    patch_size: int
    layer_norm_eps: float
    scale_factor: int  # pixel shuffle: scale × scale patches become one token
    text_hidden_size: int
    image_token_id: int

    @classmethod
    def from_hf(cls, config: Mapping) -> Idefics3VisionSpec:
        vision = {**VISION_DEFAULTS, **{k: v for k, v in (config.get("vision_config") or {}).items() if v is not None}}
        top = {**CONNECTOR_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        text = config.get("text_config") or {}
        if "hidden_size" not in text:
            raise ValueError("config.json: text_config.hidden_size is missing (the connector projects to it)")
        if vision["hidden_act"] != "gelu_pytorch_tanh":  # SigLIP's, and every Idefics3's and SmolVLM's
            raise ValueError(f"config.json: vision_config.hidden_act {vision['hidden_act']!r} is not supported "
                             "(gelu_pytorch_tanh)")
        spec = cls(int(vision["hidden_size"]), int(vision["intermediate_size"]), int(vision["num_hidden_layers"]),
                   int(vision["num_attention_heads"]), int(vision["num_channels"]),
                   _square(vision["image_size"], "image_size"), _square(vision["patch_size"], "patch_size"),
                   float(vision["layer_norm_eps"]), int(top["scale_factor"]),
                   int(text["hidden_size"]), int(top["image_token_id"]))
        spec.check()
        return spec

    def check(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"config.json: vision_config.hidden_size {self.hidden_size} does not split into "
                             f"{self.num_heads} attention heads")
        if self.image_size % self.patch_size or self.patches_per_side % self.scale_factor:
            raise ValueError(f"config.json: vision_config.image_size {self.image_size} must be a multiple of "
                             f"patch_size {self.patch_size} × scale_factor {self.scale_factor}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_image(self) -> int:
        """Prompt rows (`<image>` tokens) one tile of image_size² pixels becomes: HF's image_seq_len."""
        return (self.patches_per_side // self.scale_factor) ** 2


def _square(value, field: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"config.json: vision_config.{field} {value} is not square; only square ones are supported")
        value = value[0]
    return int(value)


def text_config(config: Mapping) -> dict:
    """The language model's config.json for kvflow's Llama: Idefics3's `text_config`, whose head is
    tied to its embedding as the top-level config says (that is the flag transformers reads)."""
    text = dict(config.get("text_config") or {})
    if text.get("model_type", "llama") != "llama":
        raise ValueError(f"config.json: text_config.model_type {text['model_type']!r} is not supported "
                         "(Idefics3's text model must be a Llama)")
    return {**text, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "tie_word_embeddings": bool(config.get("tie_word_embeddings", False))}


class VisionEmbeddings(nn.Module):
    def __init__(self, spec: Idefics3VisionSpec) -> None:
        super().__init__()
        self.patch_size, self.patches_per_side = spec.patch_size, spec.patches_per_side
        self.patch_embedding = nn.Conv2d(spec.num_channels, spec.hidden_size, spec.patch_size, spec.patch_size)
        self.position_embedding = nn.Embedding(spec.patches_per_side ** 2, spec.hidden_size)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """[N, patches, hidden]: every patch embedded, plus its position's embedding."""
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return patches + self.position_embedding(patch_position_ids(patch_mask, self.patches_per_side))


def patch_position_ids(patch_mask: torch.Tensor, side: int) -> torch.Tensor:
    """[N, h·w] position ids of a [N, h, w] grid of patches whose valid (True) part is the top-left
    n_rows × n_cols: each valid patch gets the cell of the trained side × side grid that its
    fractional coordinates (i / n) fall in, computed in float32 as transformers does (an image of
    the trained size gets 0, 1, 2, ...); padding patches get 0."""
    device = patch_mask.device
    boundaries = torch.arange(1 / side, 1.0, 1 / side, dtype=torch.float32, device=device)

    def cells(valid: torch.Tensor, length: int) -> torch.Tensor:
        step = 1.0 / valid.to(torch.float32)
        coords = torch.arange(length, dtype=torch.float32, device=device)[None, :] * step[:, None]
        return torch.bucketize(coords.clamp(max=1.0 - 1e-6), boundaries, right=True)

    rows, cols = cells(patch_mask[:, :, 0].sum(1), patch_mask.shape[1]), cells(patch_mask[:, 0, :].sum(1), patch_mask.shape[2])
    ids = rows[:, :, None] * side + cols[:, None, :]
    return ids.flatten(1).masked_fill(~patch_mask.flatten(1), 0)


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one image's patches (no KV cache: the encoder runs
    once per image). Under tensor parallelism a rank keeps its share of the heads."""

    def __init__(self, spec: Idefics3VisionSpec, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        d, heads = spec.hidden_size // spec.num_heads, spec.num_heads
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, d, heads, heads, True, quant_config, f"{prefix}.qkv_proj")
        self.head_dim, self.num_heads = d, self.qkv_proj.heads.num_heads  # this rank's heads
        self.out_proj = RowParallelLinear(spec.hidden_size, spec.hidden_size, True, quant_config, f"{prefix}.out_proj")

    def forward(self, hidden: torch.Tensor, num_images: int, key_mask: torch.Tensor | None) -> torch.Tensor:
        """hidden: [N·S, hidden] flat rows; key_mask: [N, 1, 1, S], True where a patch is valid (None: all)."""
        q, k, v = (x.view(num_images, -1, self.num_heads, self.head_dim).transpose(1, 2)
                   for x in self.qkv_proj(hidden).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return self.out_proj(out.transpose(1, 2).reshape(hidden.shape[0], -1))


class VisionMLP(nn.Module):
    def __init__(self, spec: Idefics3VisionSpec, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(spec.hidden_size, spec.intermediate_size, True, quant_config, f"{prefix}.fc1")
        self.fc2 = RowParallelLinear(spec.intermediate_size, spec.hidden_size, True, quant_config, f"{prefix}.fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionEncoderLayer(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(.))."""

    def __init__(self, spec: Idefics3VisionSpec, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.self_attn = VisionAttention(spec, quant_config, f"{prefix}.self_attn")
        self.layer_norm2 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.mlp = VisionMLP(spec, quant_config, f"{prefix}.mlp")

    def forward(self, hidden: torch.Tensor, num_images: int, key_mask: torch.Tensor | None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden), num_images, key_mask)
        return hidden + self.mlp(self.layer_norm2(hidden))


class VisionEncoder(nn.Module):
    def __init__(self, spec: Idefics3VisionSpec, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(spec, quant_config, f"{prefix}.layers.{i}")
                                    for i in range(spec.num_layers))


class VisionTransformer(nn.Module):
    def __init__(self, spec: Idefics3VisionSpec, quant_config: QuantizationConfig | None,
                 prefix: str = "model.vision_model") -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(spec)
        self.encoder = VisionEncoder(spec, quant_config, f"{prefix}.encoder")
        self.post_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """[N, patches, hidden] from [N, C, H, W] and its [N, H / patch, W / patch] patch mask."""
        n = pixel_values.shape[0]
        hidden = self.embeddings(pixel_values, patch_mask)
        key_mask = None if bool(patch_mask.all()) else patch_mask.view(n, 1, 1, -1)
        hidden = hidden.flatten(0, 1)  # flat rows, as every linear layer of kvflow takes them
        for layer in self.encoder.layers:
            hidden = layer(hidden, n, key_mask)
        return self.post_layernorm(hidden).view(n, -1, hidden.shape[-1])


class ModalityProjection(nn.Module):
    def __init__(self, spec: Idefics3VisionSpec, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.proj = ReplicatedLinear(spec.hidden_size * spec.scale_factor ** 2, spec.text_hidden_size, False,
                                     quant_config, f"{prefix}.proj")


class Connector(nn.Module):
    def __init__(self, spec: Idefics3VisionSpec, quant_config: QuantizationConfig | None,
                 prefix: str = "model.connector") -> None:
        super().__init__()
        self.scale_factor = spec.scale_factor
        self.modality_projection = ModalityProjection(spec, quant_config, f"{prefix}.modality_projection")

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[N, side², hidden] patches → [N, (side / s)², text hidden] tokens."""
        tokens = pixel_shuffle(patches, self.scale_factor)
        return self.modality_projection.proj(tokens.flatten(0, 1)).view(*tokens.shape[:2], -1)


def pixel_shuffle(patches: torch.Tensor, scale: int) -> torch.Tensor:
    """[N, side², E] → [N, (side / scale)², scale² · E]: token (R, C) holds the patches of rows
    R·scale + i and columns C·scale + j, in (i, j) order, as Idefics3's connector lays them out."""
    n, count, width = patches.shape
    side = round(count ** 0.5)
    blocks = patches.view(n, side // scale, scale, side // scale, scale, width)
    return blocks.permute(0, 1, 3, 2, 4, 5).reshape(n, count // scale ** 2, scale * scale * width)


class Idefics3ImageEncoder(nn.Module):
    """The vision transformer and connector; `encode_images` is what the engine calls. Built like
    a kvflow model (in the device, dtype and tensor-parallel scope it is constructed in), loaded
    with `load_weights` and then `process_weights_after_loading`."""

    def __init__(self, spec: Idefics3VisionSpec, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.vision_model = VisionTransformer(spec, quant_config)
        self.connector = Connector(spec, quant_config)

    def encode_images(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[N, tokens per image, text hidden] for N square images (tiles) [N, C, H, W]: the rows
        their `<image>` tokens stand for, in order. `pixel_attention_mask` [N, H, W] marks each
        image's valid pixels (a patch is valid if any of its pixels is; None: all are). Every
        image given is encoded: transformers' batch padding (all-zero images) is the caller's to drop."""
        patch_mask = self.patch_mask(pixel_values, pixel_attention_mask)
        param = self.vision_model.embeddings.patch_embedding.weight
        patches = self.vision_model(pixel_values.to(param.device, param.dtype), patch_mask)
        return self.connector(patches)

    forward = encode_images

    def patch_mask(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None) -> torch.Tensor:
        """[N, H / patch, W / patch] bool, after checking the shapes (errors name the argument)."""
        s, shape = self.spec, tuple(pixel_values.shape)
        if pixel_values.dim() != 4 or shape[1] != s.num_channels or shape[2] != shape[3]:
            raise ValueError(f"pixel_values must be [N, {s.num_channels}, H, H] (square images); got {shape}")
        if shape[2] % (s.patch_size * s.scale_factor):
            raise ValueError(f"pixel_values: side {shape[2]} must be a multiple of patch_size {s.patch_size} × "
                             f"scale_factor {s.scale_factor}")
        grid = (shape[0], shape[2] // s.patch_size, shape[3] // s.patch_size)
        if pixel_attention_mask is None:
            return torch.ones(grid, dtype=torch.bool, device=pixel_values.device)
        if tuple(pixel_attention_mask.shape) != (shape[0], *shape[2:]):
            raise ValueError(f"pixel_attention_mask must be [N, H, W] = {(shape[0], *shape[2:])}; "
                             f"got {tuple(pixel_attention_mask.shape)}")
        p = s.patch_size
        patch_mask = pixel_attention_mask.bool().view(grid[0], grid[1], p, grid[2], p).any(4).any(2)
        empty = (~patch_mask[:, 0, 0]).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"pixel_attention_mask: images {empty} have no valid pixel in their first patch "
                             "(valid pixels must be the top-left part of an image)")
        return patch_mask

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Tensors named as in this module (`vision_model.*`, `connector.*`: `Idefics3Checkpoint.vision_weights`)."""
        load_named_weights(self, weights, VISION_STACKED_PARAMS)


class Idefics3Checkpoint:
    """One pass over an Idefics3 checkpoint's tensors: `text_weights()` yields the language
    model's, renamed for kvflow's Llama (`model.text_model.X` → `model.X`, `lm_head.weight` as is),
    and sets the vision tower's and connector's aside (`model.` dropped), which `vision_weights`
    returns once that pass is over. The text model, the large part, so streams from the files as
    any checkpoint does; only the encoder's tensors (about 0.1-0.4 B parameters) wait in memory."""

    VISION_PREFIXES = ("model.vision_model.", "model.connector.")
    TEXT_PREFIX = "model.text_model."

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._weights = iter(weights)
        self._vision: list[tuple[str, torch.Tensor]] = []
        self._text_done = False

    def text_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._weights:
            if name.startswith(self.VISION_PREFIXES):
                self._vision.append((name.removeprefix("model."), tensor))
            elif name.startswith(self.TEXT_PREFIX):
                yield "model." + name.removeprefix(self.TEXT_PREFIX), tensor
            elif name == "lm_head.weight":
                yield name, tensor
            else:
                raise ValueError(f"checkpoint tensor {name!r} belongs to no part of an Idefics3 model "
                                 f"({', '.join(self.VISION_PREFIXES)}, {self.TEXT_PREFIX}, lm_head.weight)")
        self._text_done = True

    def vision_weights(self) -> list[tuple[str, torch.Tensor]]:
        if not self._text_done:
            raise RuntimeError("Idefics3Checkpoint: load the text model from text_weights() first; the vision "
                               "tensors are collected during that pass")
        return self._vision
