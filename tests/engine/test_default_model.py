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


def _spanning_stop(tokenizer, token_ids: list[int], text: str, skip: int = 2) -> tuple[str, int]:
    """A 4-character stop string that straddles a token boundary and first occurs there."""
    bounds = [len(tokenizer.decode(token_ids[:i], skip_special_tokens=True)) for i in range(len(token_ids) + 1)]
    for k in range(skip, len(bounds) - 1):
        left, right = bounds[k] - bounds[k - 1], bounds[k + 1] - bounds[k]
        stop = text[bounds[k] - 2:bounds[k] + 2]
        if left >= 2 and right >= 2 and text.find(stop) == bounds[k] - 2:
            return stop, bounds[k] - 2
    raise AssertionError(f"no token boundary to test in {text!r}")


@pytest.mark.slow
def test_stop_string_across_tokens_ends_the_output_exactly(llm):
    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Write one sentence about the sea."}],
                                                     tokenize=True)
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    stop, start = _spanning_stop(llm.get_tokenizer(), full.token_ids, full.text)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (full.text[:start], "stop", stop)


@pytest.mark.slow
def test_streamed_deltas_concatenate_to_the_final_text_and_never_leak_a_stop_string(llm):
    from kvflow import RequestOutputKind

    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "List five fruits, one per line."}],
                                                     tokenize=True)
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48))[0].outputs[0]
    stop, start = _spanning_stop(llm.get_tokenizer(), full.token_ids, full.text, skip=8)
    engine = llm.llm_engine
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=48, stop=[stop],
                                                   output_kind=RequestOutputKind.DELTA))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o.outputs[0].text for o in engine.step()]
    assert "".join(deltas) == full.text[:start]
    # Text that could begin the stop string was held back: no prefix of the stream ever shows it.
    assert all(stop[:2] not in "".join(deltas[:i])[start - 1:] for i in range(len(deltas) + 1))
