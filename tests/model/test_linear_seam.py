"""The layer seam: fused shards land in their rows, tensor-parallel ranks keep their slice, a
quant method owns the parameters' layout, and the tied LM head is the embedding itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_tiny_model
from torch import nn

from kvflow import LLM, SamplingParams
from kvflow.attention.backend import get_attention_backend
from kvflow.model.arch_config import ArchConfig
from kvflow.model.layers.embedding import VocabParallelEmbedding
from kvflow.model.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvflow.model.loader.hf import load_hf_dir
from kvflow.model.loader.weights import process_weights_after_loading
from kvflow.model.registry import build_model
from kvflow.quant.base import QuantizationConfig, QuantMethod, set_weight_attrs


def test_qkv_shards_fill_their_rows():
    layer = QKVParallelLinear(8, head_dim=2, num_heads=4, num_kv_heads=1, bias=True)
    q, k, v = torch.randn(8, 8), torch.randn(2, 8), torch.randn(2, 8)
    for shard_id, w in (("v", v), ("q", q), ("k", k)):  # any order
        layer.weight_loader(layer.weight, w, shard_id)
        layer.weight_loader(layer.bias, w[:, 0], shard_id)
    assert torch.equal(layer.weight, torch.cat([q, k, v]))
    assert torch.equal(layer.bias, torch.cat([q, k, v])[:, 0])
    with pytest.raises(ValueError, match="has no shard 0"):
        layer.weight_loader(layer.weight, q, 0)


def test_merged_shard_of_wrong_shape_is_refused():
    layer = MergedColumnParallelLinear(4, [6, 6])
    with pytest.raises(ValueError, match=r"has shape \(5, 4\), expected \(6, 4\)"):
        layer.weight_loader(layer.weight, torch.randn(5, 4), 1)


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_ranks_keep_their_slice(rank):
    full = torch.randn(8, 6)
    column = ColumnParallelLinear(6, 8, tp_rank=rank, tp_size=2)
    column.weight_loader(column.weight, full)
    assert torch.equal(column.weight, full[4 * rank:4 * rank + 4])
    row = RowParallelLinear(6, 8, tp_rank=rank, tp_size=2)
    row.weight_loader(row.weight, full)
    assert torch.equal(row.weight, full[:, 3 * rank:3 * rank + 3])
    gate, up = torch.randn(8, 6), torch.randn(8, 6)
    merged = MergedColumnParallelLinear(6, [8, 8], tp_rank=rank, tp_size=2)
    merged.weight_loader(merged.weight, gate, 0)
    merged.weight_loader(merged.weight, up, 1)
    assert torch.equal(merged.weight, torch.cat([gate[4 * rank:4 * rank + 4], up[4 * rank:4 * rank + 4]]))


class TransposedMethod(QuantMethod):
    """A stand-in for a quantized layout: W stored as W^T [in, out] (output_dim=1), and doubled
    after loading. A method names its parameters as the checkpoints it loads do ("weight")."""

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        w = nn.Parameter(torch.empty(input_size, sum(output_sizes)), requires_grad=False)
        layer.register_parameter("weight", set_weight_attrs(w, output_dim=1, input_dim=0,
                                                              weight_loader=self.load_transposed(layer)))

    @staticmethod
    def load_transposed(layer):
        def loader(param, loaded, shard_id=None):
            layer.weight_loader(param, loaded.t(), shard_id)
        return loader

    def process_weights_after_loading(self, layer):
        layer.weight.data.mul_(2)

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight.t() / 2, bias)

    def embedding(self, layer, ids):
        return layer.weight.t()[ids] / 2


class TransposedConfig(QuantizationConfig):
    name = "transposed"

    def get_quant_method(self, kind, prefix):
        return TransposedMethod()


@pytest.mark.parametrize("arch", ["llama-mha-tied", "qwen2-bias", "qwen3-qknorm"])
def test_a_quant_method_owns_the_layout_and_the_model_does_not_notice(arch, tmp_path):
    make_tiny_model(arch, tmp_path)
    cfg = ArchConfig.from_hf(load_hf_dir(tmp_path, load_tokenizer=False).hf_config)
    backend = get_attention_backend("torch_reference")
    models = []
    for quant_config in (None, TransposedConfig()):
        model = build_model(cfg, backend, quant_config=quant_config)
        model.load_weights(load_hf_dir(tmp_path, load_tokenizer=False).weights)
        process_weights_after_loading(model)
        models.append(model)
    plain, transposed = models
    qkv = transposed.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.shape == (qkv.input_size, sum(qkv.output_sizes))
    hidden = torch.randn(5, cfg.hidden_size)
    torch.testing.assert_close(transposed.compute_logits(hidden), plain.compute_logits(hidden))
    ids = torch.tensor([0, 3, 96])
    torch.testing.assert_close(transposed.model.embed_tokens(ids), plain.model.embed_tokens(ids))
    for name, layer in plain.named_modules():
        if hasattr(layer, "quant_method") and not isinstance(layer, VocabParallelEmbedding):
            x = torch.randn(3, layer.input_size)
            torch.testing.assert_close(transposed.get_submodule(name)(x), layer(x))


def test_tied_head_is_the_embedding(tmp_path):
    make_tiny_model("llama-mha-tied", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True)
    model = llm.llm_engine.runner.model
    assert model.lm_head is model.model.embed_tokens
    assert isinstance(model.lm_head, VocabParallelEmbedding)
    assert [n for n, _ in model.named_parameters() if "embed" in n or "lm_head" in n] == ["model.embed_tokens.weight"]
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_a_missing_shard_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_tiny_model("llama-mqa", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing weights: model.layers.0.self_attn.qkv_proj.weight"):
        LLM(str(tmp_path), skip_tokenizer_init=True)
