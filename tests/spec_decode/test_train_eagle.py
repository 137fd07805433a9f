"""`kvflow train-drafter --method eagle` on a tiny random Llama (llama3 RoPE scaling, grouped KV
heads): the target's features are transformers' final hidden states; a saved head means, read by
transformers' own Llama layer from its config.json and tensors, what the trainer computed; training
lowers the loss; a resumed run is bit for bit an uninterrupted one; the command writes a checkpoint
of exactly the format's tensors, and refuses bad arguments by name."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import COMMON, TINY_CONFIGS, make_tiny_model, write_tiny_tokenizer

from kvflow import LLM
from kvflow.entrypoints.cli import main
from kvflow.model.arch_config import ArchConfig
from kvflow.spec_decode.train_eagle import (
    OPTIMIZER_FILE,
    STATE_FILE,
    Trainer,
    TrainSettings,
    eagle_losses,
    make_batch,
    run_training,
)
from kvflow.spec_decode.train_eagle_data import Sequence
from kvflow.spec_decode.train_eagle_head import EagleHead, HeadShape, eagle_config, load_head_tensors, save_head
from kvflow.spec_decode.train_eagle_target import check_target, frozen_target, last_layer_tensors, target_features

TINY = "llama-gqa-llama3-rope"
SMALL = dict(seq_len=40, batch_size=2, text_tokens=400, chat_prompts=2, save_every=2)
KVFLOW = Path(sys.executable).parent / "kvflow"  # the console script pip installed: the entry point


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, transformers model, kvflow LLM of it in float32 without prefix caching)."""
    path = tmp_path_factory.mktemp("tiny-eagle-target")
    hf = make_tiny_model(TINY, path)
    write_tiny_tokenizer(path)
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=False, swap_space_gb=0, disable_log_stats=True,
              block_size=16)
    return path, hf, llm


def _sequences(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    # Lengths across block boundaries (16), several in one feature pass.
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (37, 5, 64, 16)]


def _head(llm) -> EagleHead:
    engine = llm.llm_engine
    model = engine.runner.model
    head = EagleHead(HeadShape.from_arch(engine.arch), frozen_target(model))
    head.init_from_target(last_layer_tensors(model))
    return head


@pytest.mark.parametrize("backend", ["default", "torch_reference"])
def test_features_are_the_targets_final_hidden_states_after_its_norm(tiny, backend):
    """The default backend attends a fresh sequence over its own K/V; the oracle reads them back
    from the pool, so there each sequence's blocks must be its own."""
    path, hf, llm = tiny
    if backend != "default":
        llm = LLM(str(path), dtype="float32", enable_prefix_caching=False, swap_space_gb=0, disable_log_stats=True,
                  block_size=16, attention_backend=backend)
    sequences = _sequences(hf.config.vocab_size)
    features = target_features(llm.llm_engine, sequences)
    for seq, ours in zip(sequences, features):
        with torch.no_grad():
            expected = hf.model(torch.tensor([seq])).last_hidden_state[0]
        assert ours.shape == (len(seq), hf.config.hidden_size)
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def _transformers_head(directory: Path, hf):
    """h and logits of a saved head as transformers computes them from its config.json and tensors:
    fc, then transformers' own Llama decoder layer with its input norm taken out, then the target's
    LM head. Independent of the trainer's module."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig.from_pretrained(directory)
    config._attn_implementation = "eager"
    tensors = load_file(str(directory / "model.safetensors"))
    layer = LlamaDecoderLayer(config, 0).eval()
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in tensors.items() if k.startswith("layers.0.")},
                          strict=False)
    layer.input_layernorm = torch.nn.Identity()
    rotary = LlamaRotaryEmbedding(config)

    def run(next_tokens: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat((hf.model.embed_tokens(next_tokens), features), dim=-1) @ tensors["fc.weight"].T
        length = x.shape[1]
        positions = torch.arange(length)[None]
        causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
        h = layer(x, attention_mask=causal, position_ids=positions, position_embeddings=rotary(x, positions))
        return h, hf.lm_head(h)

    return run


def test_a_saved_head_computes_what_the_format_says(tiny, tmp_path):
    path, hf, llm = tiny
    head = _head(llm)
    with torch.no_grad():  # away from the initial [0 | I], so both halves of fc and every weight matter
        gen = torch.Generator().manual_seed(5)
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    config = eagle_config(json.loads((path / "config.json").read_text()), llm.llm_engine.arch)
    save_head(head, config, tmp_path, {"step": "0"})
    sequences = _sequences(hf.config.vocab_size)
    items = [(Sequence(s), f) for s, f in zip(sequences, target_features(llm.llm_engine, sequences))]
    batch = make_batch(items[:1], None)
    with torch.no_grad():
        ours = head(batch.next_tokens, batch.features)
        h, logits = _transformers_head(tmp_path, hf)(batch.next_tokens, batch.features)
        torch.testing.assert_close(ours, h, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(head.logits(ours), logits, atol=1e-3, rtol=1e-4)


def test_training_steps_lower_the_loss_on_a_fixed_batch(tiny):
    _, hf, llm = tiny
    sequences = _sequences(hf.config.vocab_size)[:1]
    items = [(Sequence(s), f) for s, f in zip(sequences, target_features(llm.llm_engine, sequences))]
    trainer = Trainer(_head(llm), items, [], TrainSettings(lr=3e-3, batch_size=1, max_steps=30))
    fixed = make_batch(items, None)
    with torch.no_grad():
        before = eagle_losses(trainer.head, fixed)
    for _ in range(30):
        trainer.train_step()
    with torch.no_grad():
        after = eagle_losses(trainer.head, fixed)
    assert after.total < 0.7 * before.total
    assert after.feature < before.feature and after.token < before.token


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def test_the_checkpoint_holds_exactly_the_formats_tensors_and_config(tiny, tmp_path):
    path, hf, llm = tiny
    result = run_training(llm, tmp_path / "head", TrainSettings(max_steps=1, **SMALL), progress=False)
    assert result.step == 1 and 0.0 <= result.held_out_top1 <= 1.0
    h, i, d = hf.config.hidden_size, hf.config.intermediate_size, hf.config.head_dim
    q, kv = hf.config.num_attention_heads * d, hf.config.num_key_value_heads * d
    expected = {"fc.weight": (h, 2 * h), "layers.0.self_attn.q_proj.weight": (q, h),
                "layers.0.self_attn.k_proj.weight": (kv, h), "layers.0.self_attn.v_proj.weight": (kv, h),
                "layers.0.self_attn.o_proj.weight": (h, q), "layers.0.mlp.gate_proj.weight": (i, h),
                "layers.0.mlp.up_proj.weight": (i, h), "layers.0.mlp.down_proj.weight": (h, i),
                "layers.0.post_attention_layernorm.weight": (h,)}
    # Loaders read every *.safetensors at the top of a model directory: only the head's is there.
    assert sorted(p.name for p in (tmp_path / "head").glob("*.safetensors")) == ["model.safetensors"]
    saved = _tensors(tmp_path / "head" / "model.safetensors")
    assert {name: tuple(t.shape) for name, t in saved.items()} == expected
    assert all(t.dtype == torch.float32 for t in saved.values())
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    target = hf.config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert (config["hidden_size"], config["intermediate_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == (
        h, i, target.num_attention_heads, target.num_key_value_heads, d, target.vocab_size)
    assert config["rms_norm_eps"] == target.rms_norm_eps
    assert config["max_position_embeddings"] == target.max_position_embeddings
    rope = TINY_CONFIGS[TINY][1]  # the target's RoPE, which the head's positions must share
    assert config["rope_theta"] == rope["rope_theta"]
    assert config["rope_scaling"]["rope_type"] == rope["rope_scaling"]["rope_type"] == "llama3"
    assert "quantization_config" not in config


def test_resume_after_n_steps_equals_n_plus_m_steps_bit_for_bit(tiny, tmp_path):
    _, _, llm = tiny
    whole = run_training(llm, tmp_path / "whole", TrainSettings(max_steps=7, **SMALL), progress=False)
    run_training(llm, tmp_path / "parts", TrainSettings(max_steps=3, **SMALL), progress=False)
    resumed = run_training(llm, tmp_path / "parts", TrainSettings(max_steps=7, **SMALL), resume=True, progress=False)
    assert whole.step == resumed.step == 7
    for name in ("model.safetensors", OPTIMIZER_FILE):
        a, b = _tensors(tmp_path / "whole" / name), _tensors(tmp_path / "parts" / name)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert whole.losses == resumed.losses and whole.held_out_top1 == resumed.held_out_top1


def test_ctrl_c_saves_the_finished_step_and_resume_continues_it(tiny, tmp_path, monkeypatch):
    _, _, llm = tiny
    step = Trainer.train_step

    def interrupted_at_third(self):
        losses = step(self)
        if self.step == 3:
            signal.raise_signal(signal.SIGINT)  # mid-run, as a user's Ctrl-C arrives
        return losses

    monkeypatch.setattr(Trainer, "train_step", interrupted_at_third)
    with pytest.raises(KeyboardInterrupt):
        run_training(llm, tmp_path / "out", TrainSettings(max_steps=6, **SMALL), progress=False)
    assert json.loads((tmp_path / "out" / STATE_FILE).read_text())["step"] == 3
    monkeypatch.setattr(Trainer, "train_step", step)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler was put back
    resumed = run_training(llm, tmp_path / "out", TrainSettings(max_steps=6, **SMALL), resume=True, progress=False)
    assert resumed.step == 6


def test_the_command_writes_a_loadable_head(tiny, tmp_path):
    path, hf, _ = tiny
    out = tmp_path / "head"
    proc = subprocess.run([str(KVFLOW), "train-drafter", str(path), str(out), "--method", "eagle", "--max-steps", "2",
                           "--seq-len", "40", "--text-tokens", "300", "--chat-prompts", "2", "--dtype", "float32"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "held-out top-1 agreement" in proc.stdout
    from transformers import LlamaConfig

    config = LlamaConfig.from_pretrained(out)
    assert config.num_hidden_layers == 1 and config.hidden_size == hf.config.hidden_size
    tensors = load_head_tensors(out / "model.safetensors", HeadShape.from_arch(ArchConfig.from_hf(config.to_dict())))
    assert len(tensors) == 9
    assert json.loads((out / STATE_FILE).read_text())["step"] == 2


@pytest.mark.parametrize(("flags", "message"), [
    (["--method", "mtp", "--max-steps", "1"], "--method 'mtp' is not trained by train-drafter"),
    (["--method", "draft_model", "--max-steps", "1"], "--method 'draft_model'"),
    (["--method", "eagle"], "give --max-steps or --time-budget"),
    (["--method", "eagle", "--max-steps", "1", "--seq-len", "2"], "--seq-len must be >= 4"),
    (["--method", "eagle", "--max-steps", "1", "--lr", "0"], "--lr must be > 0"),
    (["--method", "eagle", "--time-budget", "-5"], "--time-budget must be > 0"),
    (["--method", "eagle", "--max-steps", "-1"], "--max-steps must be >= 0"),
    (["--method", "eagle", "--max-steps", "1", "--batch-size", "0"], "--batch-size must be >= 1"),
])
def test_bad_arguments_are_refused_by_name_before_any_work(flags, message, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["train-drafter", str(tmp_path / "no-model"), str(out), *flags]) == 1
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_resume_refuses_a_missing_or_different_checkpoint(tiny, tmp_path):
    _, _, llm = tiny
    with pytest.raises(FileNotFoundError, match="holds no checkpoint to resume"):
        run_training(llm, tmp_path / "empty", TrainSettings(max_steps=1, **SMALL), resume=True, progress=False)
    run_training(llm, tmp_path / "out", TrainSettings(max_steps=1, **SMALL), progress=False)
    with pytest.raises(ValueError, match="--seq-len 48 differs from the checkpoint's 40"):
        run_training(llm, tmp_path / "out", TrainSettings(max_steps=2, **{**SMALL, "seq_len": 48}), resume=True,
                     progress=False)
    with pytest.raises(ValueError, match="holds a training checkpoint already: continue it with --resume"):
        run_training(llm, tmp_path / "out", TrainSettings(max_steps=2, **SMALL), progress=False)
    shutil.copy(tmp_path / "out" / "model.safetensors", tmp_path / "model-step-1.safetensors")
    run_training(llm, tmp_path / "out", TrainSettings(max_steps=2, **SMALL), resume=True, progress=False)
    shutil.copy(tmp_path / "model-step-1.safetensors", tmp_path / "out" / "model.safetensors")  # a cut-short save
    with pytest.raises(ValueError, match="is not from step 2"):
        run_training(llm, tmp_path / "out", TrainSettings(max_steps=3, **SMALL), resume=True, progress=False)


def test_a_target_an_eagle_1_head_cannot_follow_is_refused_by_what_differs():
    import transformers

    qwen2 = transformers.Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2).to_dict()
    with pytest.raises(ValueError, match="Qwen2ForCausalLM"):
        check_target(ArchConfig.from_hf({**qwen2, "architectures": ["Qwen2ForCausalLM"]}))
    llama = transformers.LlamaConfig(**COMMON, num_attention_heads=4, attention_bias=True).to_dict()
    with pytest.raises(ValueError, match="LlamaForCausalLM with attention_bias"):
        check_target(ArchConfig.from_hf({**llama, "architectures": ["LlamaForCausalLM"]}))
