"""The transformers oracle for the real models (the default SmolLM2 and Gemma-3-270M).

transformers reads the default GGUF slowly (it dequantizes every tensor, ~15 s), so it is done once
and saved as a plain float32 HF directory under `<repo>/.cache`; tests then reload that directory
in well under a second with `from_pretrained(default_model_hf_dir())`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from kvflow.model.default_model import default_model_path

REPO_ROOT = Path(__file__).resolve().parents[1]
HF_DIR = REPO_ROOT / ".cache" / "hf-smollm2-135m"
# Written last: a directory without it was interrupted mid-save and is rebuilt.
_COMPLETE = ".complete"


def default_gguf_path() -> Path:
    return default_model_path()


def default_model_hf_dir() -> Path:
    """A float32 HF directory (model + tokenizer) that transformers made from the default GGUF."""
    return hf_dir_from_gguf(default_gguf_path(), HF_DIR)


def gemma3_270m_hf_dir() -> Path:
    """The same for Gemma-3-270M (its GGUF assembled from the packages into kvflow's cache)."""
    from kvflow.model.packaged_models import gemma3_270m_path

    return hf_dir_from_gguf(gemma3_270m_path(), REPO_ROOT / ".cache" / "hf-gemma3-270m")


def hf_dir_from_gguf(gguf_path: Path, out: Path) -> Path:
    if (out / _COMPLETE).is_file():
        return out
    if out.exists():
        shutil.rmtree(out)
    _convert_with_transformers(gguf_path, out)
    (out / _COMPLETE).write_text("ok\n")
    return out


def _convert_with_transformers(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The weights are already dequantized; drop the GGUF marker so the saved dir loads as plain HF.
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def assert_matches_oracle(hf, prompt: list[int], out, steps: int) -> None:
    """`out` (a RequestOutput with logprobs, and prompt logprobs if asked for) against a full-sequence
    forward of transformers model `hf`: every logprob within 1e-4, each greedy token the oracle's
    argmax wherever the oracle's top two are not a near-tie."""
    import torch

    completion = out.outputs[0]
    assert len(completion.token_ids) == steps
    sequence = prompt + completion.token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([sequence])).logits[0].float().log_softmax(-1)
    if out.prompt_logprobs is not None and len(prompt) > 1:
        # Position p holds log P(prompt[p] | prompt[:p]); position 0 has none.
        assert out.prompt_logprobs[0] is None
        ours = torch.tensor([out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))])
        expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    rows = torch.arange(len(prompt) - 1, len(sequence) - 1)
    ours = torch.tensor([lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)])
    torch.testing.assert_close(ours, ref[rows, torch.tensor(completion.token_ids)], atol=1e-4, rtol=0)
    top2 = ref[rows].topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 1e-3  # skip exact near-ties, where float noise decides
    assert torch.equal(ref[rows].argmax(-1)[decided], torch.tensor(completion.token_ids)[decided])
