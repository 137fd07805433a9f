"""Missing or corrupt model files end in an error that names the problem."""

from __future__ import annotations

import json

import pytest
from tiny_models import make_tiny_model

from kvflow import LLM


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(str(tmp_path))


def test_pickled_weights_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ValueError, match="never loads"):
        LLM(str(tmp_path))


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    make_tiny_model("llama-mqa", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    supported = ("'GPTNeoXForCausalLM' is not supported; supported: .*Gemma3ForCausalLM, "
                 "Idefics3ForConditionalGeneration, Lfm2ForCausalLM, LlamaForCausalLM, Mamba2ForCausalLM")
    with pytest.raises(ValueError, match=supported):
        LLM(str(tmp_path), skip_tokenizer_init=True)


def test_corrupt_safetensors(tmp_path):
    make_tiny_model("llama-mqa", tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(ValueError, match="cannot read weights from .*model.safetensors"):
        LLM(str(tmp_path), skip_tokenizer_init=True)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_tiny_model("llama-mqa", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing weights: model.layers.1.mlp.down_proj.weight"):
        LLM(str(tmp_path), skip_tokenizer_init=True)


def test_bad_engine_args_name_the_flag(tmp_path):
    make_tiny_model("llama-mqa", tmp_path)
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(tmp_path), skip_tokenizer_init=True, block_size=3)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(tmp_path), skip_tokenizer_init=True, dtype="int3")


@pytest.mark.parametrize("shard", ["../elsewhere.safetensors", "/tmp/../{outside}/elsewhere.safetensors"])
def test_shard_names_in_an_index_must_stay_inside_the_model_directory(tmp_path, shard):
    model_dir = tmp_path / "model"
    make_tiny_model("llama-mqa", model_dir)
    (model_dir / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")  # real weights, outside
    shard = shard.format(outside=tmp_path)
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": shard}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="shard names must stay inside"):
        LLM(str(model_dir), skip_tokenizer_init=True)
