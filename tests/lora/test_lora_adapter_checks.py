"""What an adapter must be to load, and what the manager keeps of the adapters it has seen.

- Weights NaN or infinite as they would be served (the file's values, A cast to the serving
  dtype, B multiplied by its scale and cast) are refused, naming the adapter and the tensor.
- `rank_pattern` / `alpha_pattern` keys that are no regular expression, and values that are no
  positive number, are refused naming the adapter and the pattern (not an re.error or TypeError).
- Errors name the adapter, never the directory it was read from.
- The manager forgets a removed adapter once no request uses it and retires its id for good:
  loading and removing adapters for ever keeps only what is loaded, and no id ever names a second
  adapter (its cached blocks could be served to it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft_adapters import make_adapter
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model

from kvflow import EngineArgs, LLMEngine, LoRARequest, SamplingParams
from kvflow.lora.manager import RetiredIds
from kvflow.lora.peft_adapter import load_peft_adapter

MAX_RANK = 8
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = tmp_path_factory.mktemp("base")
    return make_tiny_model("llama-gqa-llama3-rope", directory), str(directory)


@pytest.fixture(scope="module")
def engine(base) -> LLMEngine:
    return LLMEngine(EngineArgs(base[1], dtype="float32", skip_tokenizer_init=True, enable_lora=True, max_loras=2,
                                max_lora_rank=MAX_RANK, disable_log_stats=True))


def _adapter(base, directory: Path, **config) -> Path:
    make_adapter(base[0], directory, seed=0, r=4, lora_alpha=8, **config)
    return directory


def _set_value(directory: Path, suffix: str, value: float, dtype: torch.dtype = torch.float32) -> str:
    """Write `value` into one element of the first tensor whose name ends in `suffix`; its module."""
    path = directory / "adapter_model.safetensors"
    tensors = load_file(path)
    name = sorted(n for n in tensors if n.endswith(suffix))[0]
    tensors[name] = tensors[name].to(dtype)
    tensors[name][0, 0] = value
    save_file(tensors, path)
    return name.removeprefix("base_model.model.").removesuffix(".weight")


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _load(engine: LLMEngine, directory: Path, dtype: torch.dtype = torch.float32, name: str = "x"):
    return load_peft_adapter(LoRARequest(name, 1, str(directory)), engine.runner.lora.targets, MAX_RANK, dtype)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("suffix", ["lora_A.weight", "lora_B.weight"])
def test_non_finite_weights_are_refused_naming_the_tensor(base, engine, tmp_path, value, suffix):
    directory = _adapter(base, tmp_path / "a")
    tensor = _set_value(directory, suffix, value)
    with pytest.raises(ValueError, match="LoRA adapter 'x'") as refused:
        _load(engine, directory)
    assert f"{tensor} holds NaN or infinite values" in str(refused.value)
    assert str(tmp_path) not in str(refused.value)


def test_a_b_that_overflows_once_scaled_and_cast_is_refused(base, engine, tmp_path):
    """60000 is a float16 value, and a float32 one; times the scale 8 / 4 = 2 it is past
    float16's 65504: fine as float32, refused as float16."""
    directory = _adapter(base, tmp_path / "a")
    tensor = _set_value(directory, "lora_B.weight", 60000.0)
    assert _load(engine, directory).weights  # float32 serves it
    with pytest.raises(ValueError, match="LoRA adapter 'x'") as refused:
        _load(engine, directory, torch.float16)
    assert f"{tensor} overflows float16 once multiplied by its scale 2 and cast" in str(refused.value)


def test_an_a_that_overflows_once_cast_is_refused(base, engine, tmp_path):
    directory = _adapter(base, tmp_path / "a")
    tensor = _set_value(directory, "lora_A.weight", 1e6)
    with pytest.raises(ValueError, match=f"{tensor} overflows float16 once cast"):
        _load(engine, directory, torch.float16)


@pytest.mark.parametrize("option,patterns,message", [
    ("rank_pattern", {"down_proj(": 4}, "rank_pattern key 'down_proj(' is not a valid regular expression"),
    ("alpha_pattern", {"[o_proj": 3}, "alpha_pattern key '[o_proj' is not a valid regular expression"),
    ("rank_pattern", {"down_proj": "six"}, "rank_pattern['down_proj'] must be a positive integer; got 'six'"),
    ("rank_pattern", {"down_proj": 2.5}, "rank_pattern['down_proj'] must be a positive integer; got 2.5"),
    ("rank_pattern", {"down_proj": 0}, "rank_pattern['down_proj'] must be a positive integer; got 0"),
    ("alpha_pattern", {"o_proj": None}, "alpha_pattern['o_proj'] must be a positive number; got None"),
    ("alpha_pattern", {"o_proj": True}, "alpha_pattern['o_proj'] must be a positive number; got True"),
    ("rank_pattern", ["down_proj"], "rank_pattern must map module patterns to values; got list"),
])
def test_bad_patterns_are_refused_naming_the_pattern(base, engine, tmp_path, option, patterns, message):
    directory = _adapter(base, tmp_path / "a")
    _edit_config(directory, **{option: patterns})
    with pytest.raises(ValueError, match="LoRA adapter 'x'") as refused:
        _load(engine, directory)
    assert message in str(refused.value)


def test_good_patterns_still_apply(base, engine, tmp_path):
    """A pattern that is a real regular expression picks its modules' rank and alpha, as PEFT's."""
    directory = tmp_path / "a"
    make_adapter(base[0], directory, seed=0, r=2, lora_alpha=4, rank_pattern={"(down|up)_proj": 6},
                 alpha_pattern={"o_proj": 3.0})
    adapter = _load(engine, directory)
    assert adapter.rank == 6
    o_a, o_b = next(w for (layer, _), w in adapter.weights.items() if layer.endswith("o_proj"))
    file = load_file(directory / "adapter_model.safetensors")
    raw_b = file["base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"]
    assert o_a.shape[0] == 2 and torch.equal(o_b, raw_b * 1.5)


def test_errors_never_show_the_adapter_directory(base, engine, tmp_path):
    """Whatever is wrong with it, a directory that is missing, unreadable or too long a path."""
    missing = tmp_path / "nowhere"
    too_long = tmp_path / ("d" * 300)  # one name over the file system's 255 bytes: an OSError to stat
    no_config = tmp_path / "empty"
    no_config.mkdir()
    for directory, message in ((missing, "does not exist"), (too_long, "cannot be read (File name too long)"),
                               (no_config, "no adapter_config.json")):
        with pytest.raises(ValueError, match="LoRA adapter 'x'") as refused:
            _load(engine, directory)
        assert message in str(refused.value) and str(tmp_path) not in str(refused.value)


def test_a_safetensors_error_naming_the_file_does_not_show_it(base, engine, tmp_path, monkeypatch):
    """safetensors puts the file's path in its OSError's message (here: the file went away
    between the check that it is there and the read)."""
    from kvflow.lora import peft_adapter

    def vanished(path):
        raise FileNotFoundError(f"No such file or directory: {path}")

    directory = _adapter(base, tmp_path / "a")
    monkeypatch.setattr(peft_adapter, "load_file", vanished)
    with pytest.raises(ValueError, match="LoRA adapter 'x'") as refused:
        _load(engine, directory)
    assert "No such file or directory: <adapter directory>/adapter_model.safetensors" in str(refused.value)
    assert str(tmp_path) not in str(refused.value)


# -- the manager's record of adapters ----------------------------------------------------------

def test_removed_adapters_are_forgotten_and_their_ids_retired(base, tmp_path):
    engine = LLMEngine(EngineArgs(base[1], dtype="float32", skip_tokenizer_init=True, enable_lora=True, max_loras=2,
                                  max_lora_rank=MAX_RANK, disable_log_stats=True))
    directory = str(_adapter(base, tmp_path / "a"))
    kept = LoRARequest("kept", 1, directory)
    engine.add_lora(kept)
    for lora_int_id in range(2, 202):  # a server's load / unload cycles: a fresh id each time
        engine.add_lora(LoRARequest("x" * 1000, lora_int_id, directory))
        assert engine.remove_lora(lora_int_id)
    assert set(engine.runner.lora._identities) == {1}  # only what is loaded is remembered
    assert engine.runner.lora.retired.num_ranges == 1  # ids 2..201, as one range
    for reused in (LoRARequest("x" * 1000, 7, directory), LoRARequest("other", 201, directory)):
        with pytest.raises(ValueError, match=f"lora_int_id {reused.lora_int_id} named an adapter that was removed"):
            engine.add_request("r", [1, 2, 3], PARAMS, lora_request=reused)
    assert not engine.has_unfinished_requests()
    for other, message in ((LoRARequest("kept", 1, str(tmp_path)), "already names adapter 'kept' at another path"),
                           (LoRARequest("y", 1, directory), "already names adapter 'kept'; give")):
        with pytest.raises(ValueError, match="lora_int_id 1") as refused:
            engine.add_lora(other)
        assert message in str(refused.value) and str(tmp_path) not in str(refused.value)


def test_an_adapter_removed_while_in_use_stays_for_its_requests(base, tmp_path):
    args = EngineArgs(base[1], dtype="float32", skip_tokenizer_init=True, enable_lora=True, max_loras=2,
                      max_lora_rank=MAX_RANK, disable_log_stats=True)
    lora = LoRARequest("a", 3, str(_adapter(base, tmp_path / "a")))
    alone = LLMEngine(args)
    alone.add_request("r", [5, 6, 7, 8], PARAMS, lora_request=lora)
    expected = [o for o in _steps(alone) if o.finished][0].outputs[0].token_ids
    engine = LLMEngine(args)
    engine.add_request("r", [5, 6, 7, 8], PARAMS, lora_request=lora)
    engine.step()
    assert engine.remove_lora(3)
    assert 3 not in engine.runner.lora.retired  # its request still runs with it
    got = [o for o in _steps(engine) if o.finished][0].outputs[0].token_ids
    assert got == expected
    engine.add_request("s", [1, 2], PARAMS)
    _steps(engine)  # the next step forgets it
    assert 3 in engine.runner.lora.retired and 3 not in engine.runner.lora._identities and engine.runner.lora.list_loras() == []


def _steps(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_retired_ids_merge_into_ranges():
    retired = RetiredIds()
    for lora_int_id in (5, 3, 9, 4, 7, 8, 6):  # out of order, closing gaps from either side
        retired.add(lora_int_id)
    assert retired.num_ranges == 1 and all(i in retired for i in range(3, 10))
    assert 2 not in retired and 10 not in retired
    retired.add(20)
    retired.add(5)
    assert retired.num_ranges == 2 and 20 in retired and 19 not in retired and 21 not in retired
