"""GGUF blocks run natively: decoded exactly as gguf-py decodes them, multiplied by the int4
kernel (or densely) with the dequantized weights' result, on random blocks and on the default
model's own tensors of every shape it has."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hf_oracle import default_gguf_path

from kvflow.model.layers.embedding import VocabParallelEmbedding
from kvflow.model.layers.linear import QKVParallelLinear
from kvflow.model.loader.gguf import open_gguf, raw_blocks
from kvflow.quant.gguf import GGUFConfig
from kvflow.quant.gguf_blocks import BLOCK_SIZES, GGUFBlocks, decode
from kvflow.quant.int4pack import KERNEL_MAX_ROWS, Int4Planes, planes_from_affine

# Where each block type keeps its fp16 super-scales (random bytes there could be inf/NaN).
_SCALE_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
                  "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> GGUFBlocks:
    rng = np.random.default_rng(seed)
    per_block, nbytes = BLOCK_SIZES[qtype]
    raw = rng.integers(0, 256, (n * k // per_block, nbytes), dtype=np.uint8)
    for at in _SCALE_OFFSETS[qtype]:
        raw[:, at:at + 2] = rng.uniform(-0.05, 0.05, (len(raw), 1)).astype(np.float16).view(np.uint8)
    return GGUFBlocks(qtype, torch.from_numpy(raw.reshape(n, -1)), (n, k))


def gguf_py_dequantize(blocks: GGUFBlocks) -> torch.Tensor:
    values = gguf.quants.dequantize(blocks.data.numpy(), gguf.GGMLQuantizationType[blocks.qtype])
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(blocks.shape))


@pytest.mark.parametrize("qtype", sorted(BLOCK_SIZES))
def test_decoders_match_gguf_py(qtype):
    blocks = random_blocks(qtype, 6, 512)
    assert torch.equal(decode(blocks).dequantize(), gguf_py_dequantize(blocks))


def test_unknown_block_type_is_named():
    with pytest.raises(ValueError, match="GGUF block type IQ2_XXS has no native decoder"):
        decode(GGUFBlocks("IQ2_XXS", torch.zeros(1, 66, dtype=torch.uint8), (1, 256)))


def _check(layer_out, reference, dtype):
    scale = reference.abs().max().item()
    tol = 2e-5 if dtype == torch.float32 else 3e-2  # bf16: scales, activations and outputs rounded
    assert (layer_out.float() - reference).abs().max().item() <= tol * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_layer_of_mixed_block_types(dtype):
    """q Q4_K and k Q5_K share one set of planes (two planes); v Q6_K (groups of 16) runs dense."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = QKVParallelLinear(256, head_dim=32, num_heads=4, num_kv_heads=2, quant_config=GGUFConfig(), prefix="qkv")
    finally:
        torch.set_default_dtype(prev)
    shards = {"q": random_blocks("Q4_K", 128, 256, 1), "k": random_blocks("Q5_K", 64, 256, 2),
              "v": random_blocks("Q6_K", 64, 256, 3)}
    for shard_id, blocks in shards.items():
        layer.weight.weight_loader(layer.weight, blocks, shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    assert [type(p).__name__ for p in layer.gguf_parts] == ["Int4Planes", "DenseWeight"]
    assert layer.gguf_parts[0].packed.shape[0] == 2
    weight = torch.cat([gguf_py_dequantize(b) for b in shards.values()])
    for rows in (1, KERNEL_MAX_ROWS + 36):
        x = torch.randn(rows, 256).to(dtype)
        _check(layer(x), x.float() @ weight.t(), dtype)


@pytest.fixture(scope="module")
def default_tensors():
    reader = open_gguf(default_gguf_path())
    names = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_output.weight", "blk.0.ffn_up.weight",
             "blk.0.ffn_down.weight", "token_embd.weight"]
    return {t.name: raw_blocks(t) for t in reader.tensors if t.name in names}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_default_model_shapes(default_tensors, dtype):
    """Every matmul shape of the default model (Q4_1 projections, the Q8_0 tied head), at decode
    (the kernel) and prefill (dequantized) sizes, and the embedding's row lookup."""
    for name, blocks in default_tensors.items():
        weight = gguf_py_dequantize(blocks)
        form = decode(blocks)
        planes = Int4Planes(planes_from_affine(form.u, form.scale, form.min, form.bits), form.group, dtype, name)
        for rows in ((1, 4, KERNEL_MAX_ROWS + 1) if name != "token_embd.weight" else (1, 3)):
            x = torch.randn(rows, blocks.shape[1]).to(dtype)
            _check(planes(x), x.float() @ weight.t(), dtype)
    ids = torch.tensor([0, 1, 63, 64, 4097, 49151])
    embed = VocabParallelEmbedding(49152, 576, quant_config=GGUFConfig(), prefix="embed")
    embed.weight.weight_loader(embed.weight, default_tensors["token_embd.weight"])
    embed.quant_method.process_weights_after_loading(embed)
    torch.testing.assert_close(embed(ids), gguf_py_dequantize(default_tensors["token_embd.weight"])[ids])
