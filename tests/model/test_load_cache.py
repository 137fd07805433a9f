"""What a GGUF load computes once and caches by the file's hash: the parse (config, tensor index,
tokenizer; model/loader/gguf_cache.py) and the int4 planes (quant/packed_cache.py). A second
load must neither parse nor repack, and must run exactly the same model."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvflow import EngineArgs, LLMEngine, SamplingParams
from kvflow.model.loader.gguf import load_gguf
from kvflow.quant import gguf as gguf_quant

Q = gguf.GGMLQuantizationType
HIDDEN, FF, VOCAB = 64, 128, 32


def write_tiny_llama(path, seed: int = 0) -> None:
    """One llama layer in Q4_1 (the default model's type), a Q8_0 embedding and a tiny BPE vocabulary."""
    rng = np.random.default_rng(seed)

    def q(rows, cols, qtype=Q.Q4_1):
        return gguf.quants.quantize((0.2 * rng.standard_normal((rows, cols))).astype(np.float32), qtype), qtype

    w = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", 1), ("context_length", 256), ("embedding_length", HIDDEN),
                       ("feed_forward_length", FF), ("head_count", 2), ("head_count_kv", 1),
                       ("layer_norm_rms_eps", 1e-6), ("vocab_size", VOCAB)):
        getattr(w, f"add_{key}")(value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<s>", "</s>", "h", "i", "hi", "Ġ", "Ġhi"])
    w.add_token_types([3, 3, 1, 1, 1, 1, 1])
    w.add_token_merges(["h i", "Ġ hi"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    tensors = {
        "token_embd.weight": q(VOCAB, HIDDEN, Q.Q8_0), "output_norm.weight": (np.ones(HIDDEN, np.float32), None),
        "blk.0.attn_norm.weight": (np.ones(HIDDEN, np.float32), None), "blk.0.attn_q.weight": q(HIDDEN, HIDDEN),
        "blk.0.attn_k.weight": q(32, HIDDEN), "blk.0.attn_v.weight": q(32, HIDDEN),
        "blk.0.attn_output.weight": q(HIDDEN, HIDDEN), "blk.0.ffn_norm.weight": (np.ones(HIDDEN, np.float32), None),
        "blk.0.ffn_gate.weight": q(FF, HIDDEN), "blk.0.ffn_up.weight": q(FF, HIDDEN), "blk.0.ffn_down.weight": q(HIDDEN, FF),
    }
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def tiny_gguf(tmp_path, use_cache_dir):
    use_cache_dir(tmp_path / "cache")
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    return path


def _greedy(path, dtype: str) -> tuple[list[int], dict[str, torch.Tensor]]:
    engine = LLMEngine(EngineArgs(model=str(path), dtype=dtype, num_kv_blocks=16, max_model_len=64))
    engine.add_request("r", {"prompt_token_ids": [2, 3, 4, 5, 6]}, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    tokens = []
    while engine.has_unfinished_requests():
        tokens = next(o for o in engine.step() if o.request_id == "r").outputs[0].token_ids
    return list(tokens), {k: v.clone() for k, v in engine.runner.model.state_dict().items()}


def _refuse(*args, **kwargs):
    raise AssertionError("a cached load parsed or repacked again")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_second_load_neither_parses_nor_repacks(tiny_gguf, monkeypatch, dtype):
    first_tokens, first_state = _greedy(tiny_gguf, dtype)
    monkeypatch.setattr(gguf, "GGUFReader", _refuse)
    monkeypatch.setattr(gguf_quant, "decode", _refuse)
    monkeypatch.setattr(gguf_quant, "planes_from_affine", _refuse)
    second_tokens, second_state = _greedy(tiny_gguf, dtype)
    assert second_tokens == first_tokens
    assert first_state.keys() == second_state.keys()
    for name, tensor in first_state.items():
        assert torch.equal(second_state[name], tensor), name


def test_cached_checkpoint_equals_the_parsed_one(tiny_gguf):
    first = load_gguf(tiny_gguf, native=True)
    second = load_gguf(tiny_gguf, native=True)
    assert second.hf_config == first.hf_config and second.quant_config == first.quant_config
    assert second.tokenizer.encode("hi hi") == first.tokenizer.encode("hi hi")
    assert second.tokenizer.eos_token_ids == first.tokenizer.eos_token_ids
    for (name_a, a), (name_b, b) in zip(first.weights, second.weights, strict=True):
        assert name_a == name_b
        assert torch.equal(a.data, b.data) if hasattr(a, "qtype") else torch.equal(a, b)


def test_changed_file_is_parsed_again(tiny_gguf, monkeypatch):
    load_gguf(tiny_gguf)
    write_tiny_llama(tiny_gguf, seed=1)  # same path and size, other weights
    calls = []
    real_reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: calls.append(1) or real_reader(*a, **k))
    load_gguf(tiny_gguf)
    assert calls == [1]


def test_corrupt_packed_cache_is_rebuilt(tiny_gguf):
    tokens, _ = _greedy(tiny_gguf, "float32")
    (packed,) = list((tiny_gguf.parent / "cache").rglob("packed-*.pt"))
    packed.write_bytes(b"not a torch file")
    assert _greedy(tiny_gguf, "float32")[0] == tokens
    assert packed.read_bytes() != b"not a torch file"  # rewritten


def test_unwritable_cache_directory_still_loads(tmp_path, use_cache_dir):
    blocker = tmp_path / "cache-is-a-file"
    blocker.write_text("")
    use_cache_dir(blocker)
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    assert len(_greedy(path, "float32")[0]) == 6


def test_a_save_deletes_older_codes_packed_files_beyond_the_newest_other(tmp_path):
    import os

    import torch

    from kvflow.quant import packed_cache

    cache = packed_cache.PackedWeightsCache(tmp_path, torch.bfloat16, ())
    family = cache.path.name.rsplit("-", 1)[0]
    olds = [tmp_path / f"{family}-{code}.pt" for code in ("aaa", "bbb", "ccc")]
    for age, path in enumerate(olds):
        path.write_bytes(b"old")
        os.utime(path, (1000 + age, 1000 + age))  # ccc the newest
    other_dtype = tmp_path / "packed-float32-torch0-other-ddd.pt"
    other_dtype.write_bytes(b"another dtype's")
    cache.put("layer", [{"w": torch.zeros(2)}])
    cache.save()
    assert cache.path.is_file() and olds[2].is_file() and other_dtype.is_file()
    assert not olds[0].exists() and not olds[1].exists()
    assert packed_cache.PackedWeightsCache(tmp_path, torch.bfloat16, ()).get("layer")[0]["w"].shape == (2,)


def test_a_file_is_hashed_once_while_it_stays_the_same(tmp_path, monkeypatch, use_cache_dir):
    """The cache entry's key, the file's SHA-256, is remembered by the file's identity: a start
    does not read a GGUF whole to hash it again, and a file written anew is hashed anew."""
    import hashlib
    import os

    from kvflow.model.loader import gguf_cache

    use_cache_dir(tmp_path / "cache")
    path = tmp_path / "m.gguf"
    path.write_bytes(b"first weights")
    assert gguf_cache.file_digest_remembered(path) == hashlib.sha256(b"first weights").hexdigest()
    hashed = []
    real = gguf_cache.file_digest
    monkeypatch.setattr(gguf_cache, "file_digest", lambda p: hashed.append(p) or real(p))
    assert gguf_cache.file_digest_remembered(path) == hashlib.sha256(b"first weights").hexdigest()
    assert hashed == []  # remembered
    path.write_bytes(b"other weights")  # same size; a new modification time
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 1))
    assert gguf_cache.file_digest_remembered(path) == hashlib.sha256(b"other weights").hexdigest()
    assert hashed == [path]
    (tmp_path / "cache" / "gguf" / "digests.json").write_text("not json")  # a damaged memo: hashed again
    assert gguf_cache.file_digest_remembered(path) == hashlib.sha256(b"other weights").hexdigest()


def test_a_new_entry_deletes_the_same_files_older_code_entries_beyond_the_newest_other(tiny_gguf):
    """Each change of the parsing code names a new entry: writing it deletes the same file's
    entries of other code but the newest, and leaves other files' entries and unfinished ones."""
    import os
    import shutil

    load_gguf(tiny_gguf)  # the entry of this code
    (entry,) = [p for p in (tiny_gguf.parent / "cache" / "gguf").iterdir() if p.is_dir()]
    digest = entry.name.rsplit("-", 1)[0]
    olds = [entry.with_name(f"{digest}-{code * 12}") for code in "abc"]
    for age, old in enumerate(olds):
        shutil.copytree(entry, old)
        os.utime(old / "index.json", (1000 + age, 1000 + age))  # ...ccc the newest
    unfinished = entry.with_name(f"{digest}-{'d' * 12}.123.partial")
    other_file = entry.with_name(f"{'0' * 64}-{'a' * 12}")
    unfinished.mkdir()
    other_file.mkdir()
    shutil.rmtree(entry)  # this code's entry is written again
    load_gguf(tiny_gguf)
    assert (entry / "index.json").is_file() and (olds[2] / "index.json").is_file()
    assert not olds[0].exists() and not olds[1].exists()
    assert unfinished.is_dir() and other_file.is_dir()


def test_fast_and_compact_loads_keep_their_own_packed_files(tiny_gguf):
    """`--cpu-weight-layouts compact` stores no dense copy: its packed file is its own, and a fast
    load after it still finds its dense copy cached (nothing dequantized again)."""
    def load(layouts: str):
        engine = LLMEngine(EngineArgs(model=str(tiny_gguf), dtype="bfloat16", num_kv_blocks=16, max_model_len=64,
                                      cpu_weight_layouts=layouts))
        return [layer.gguf_parts[0] for layer in engine.runner.model.modules() if hasattr(layer, "gguf_parts")]

    fast = load("fast")
    compact = load("compact")
    names = sorted(p.name for p in (tiny_gguf.parent / "cache").rglob("packed-*.pt"))
    assert len(names) == 2 and any("-compact-" in n for n in names) and any("-fast-" in n for n in names)
    assert all(getattr(p, "dense", None) is None for p in compact)
    assert any(getattr(p, "dense", None) is not None for p in fast)
    assert any(getattr(p, "dense", None) is not None for p in load("fast"))
