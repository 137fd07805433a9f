"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers' own loading of
the same file, both in float32: greedy chat continuations must be token-for-token identical."""

from __future__ import annotations

import pytest
import torch

from hf_oracle import default_model_hf_dir
from kvflow import LLM, SamplingParams

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three primary colors."}],
    [{"role": "user", "content": "Write a haiku about memory bandwidth."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Explain what a KV cache is in one paragraph."}],
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_hf_dir()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@pytest.mark.slow
def test_greedy_chat_matches_transformers(llm, hf):
    model, hf_tok = hf
    # min_tokens bans EOS until 48 tokens, exactly as transformers' min_new_tokens does.
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outputs = llm.chat(CONVERSATIONS, params)
    for conversation, out in zip(CONVERSATIONS, outputs):
        prompt_ids = hf_tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert out.prompt_token_ids == list(prompt_ids)  # same template, same tokenizer
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 min_new_tokens=NEW_TOKENS, pad_token_id=hf_tok.eos_token_id)
        expected = ref[0, len(prompt_ids):].tolist()
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].text == hf_tok.decode(expected, skip_special_tokens=True)


@pytest.mark.slow
def test_text_prompt_tokenizes_like_transformers(llm, hf):
    _, hf_tok = hf
    tokenizer = llm.get_tokenizer()
    for text in ["The quick brown fox", "  spaces  and\nnewlines", "数字 123 and émojis 🎉"]:
        assert tokenizer.encode(text) == hf_tok(text)["input_ids"]
