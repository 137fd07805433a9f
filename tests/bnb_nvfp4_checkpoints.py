"""What the bitsandbytes and NVFP4 checkpoint tests share: a quantized checkpoint's layers built at one
rank and at each of two tensor-parallel ranks, compared part by part."""

from __future__ import annotations

import torch

from kvflow.attention.backend import get_attention_backend
from kvflow.distributed.parallel_state import TensorParallel, tensor_parallel_scope
from kvflow.model.arch_config import ArchConfig
from kvflow.model.loader.hf import load_hf_dir
from kvflow.model.loader.weights import process_weights_after_loading
from kvflow.model.registry import build_model
from kvflow.quant.registry import get_quantization_config


def _model(path, tp: TensorParallel):
    checkpoint = load_hf_dir(path, load_tokenizer=False)
    with tensor_parallel_scope(tp):
        model = build_model(ArchConfig.from_hf(checkpoint.hf_config), get_attention_backend("torch_reference"),
                            quant_config=get_quantization_config(None, None, checkpoint.quant_config))
    model.load_weights(checkpoint.weights)
    process_weights_after_loading(model)
    return model


def assert_two_ranks_hold_the_full_layers(path) -> int:
    """Each quantized layer's dequantized weight at two ranks is the one-rank layer's, split as tensor
    parallelism splits it: column-parallel shards by rows (each checkpoint layer of a fused one apart),
    row-parallel layers by columns. Returns how many layers were compared."""
    full = _model(path, TensorParallel())
    ranks = [_model(path, TensorParallel(r, 2)) for r in range(2)]
    compared = 0
    for name, module in full.named_modules():
        if not hasattr(module, "quant_runtime"):
            continue
        weight = module.quant_runtime.dequantize(torch.float32)
        layers = [m.get_submodule(name) for m in ranks]
        parts = [layer.quant_runtime.dequantize(torch.float32) for layer in layers]
        if layers[0].tp_split == "input":
            joined = torch.cat(parts, dim=1)
        else:  # each shard's rows from both ranks, shard after shard
            by_shard = zip(*(part.split(layer.output_sizes) for part, layer in zip(parts, layers)))
            joined = torch.cat([torch.cat(pieces) for pieces in by_shard])
        assert torch.equal(joined, weight), name
        compared += 1
    return compared
