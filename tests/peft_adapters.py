"""Random PEFT LoRA adapters for tiny models, and PEFT itself as the oracle of adapted logprobs.

Adapters are made with `init_lora_weights=False`: PEFT's default starts B at zero, an adapter
that changes nothing and so passes any test."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base, directory: Path, seed: int, **lora_config):
    """Save a random adapter for `base` (a transformers model, left untouched) to `directory`;
    returns the PEFT model, in eval mode."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ALL_MODULES, "init_lora_weights": False,
                           **lora_config})
    peft_model = get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():  # PEFT's random init is small; a larger B makes the adapter matter
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(4)
    peft_model.save_pretrained(directory)
    return peft_model


def logprobs(model, sequence: list[int]) -> torch.Tensor:
    """[len, vocab] log-probabilities of a transformers (or PEFT) model over one sequence."""
    with torch.no_grad():
        return model(torch.tensor([sequence])).logits[0].float().log_softmax(-1)


def check_logprobs(out, model, atol: float = 1e-4) -> None:
    """A RequestOutput made with prompt_logprobs=0 and logprobs=0 matches `model` at every
    prompt and output position."""
    prompt, completion = out.prompt_token_ids, out.outputs[0]
    sequence = prompt + completion.token_ids
    ref = logprobs(model, sequence)
    ours = [out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))]
    ours += [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
    expected = ref[torch.arange(len(sequence) - 1), torch.tensor(sequence[1:])]
    torch.testing.assert_close(torch.tensor(ours), expected, atol=atol, rtol=0)
    # Greedy outputs are the oracle's argmax, wherever it is not a near-tie float noise decides.
    rows = ref[len(prompt) - 1:len(sequence) - 1]
    top2 = rows.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 1e-3
    assert torch.equal(rows.argmax(-1)[decided], torch.tensor(completion.token_ids)[decided])
