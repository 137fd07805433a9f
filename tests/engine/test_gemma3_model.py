"""The real Gemma-3-270M (Q4_K_M GGUF from its packages) against transformers' own float32 load
of the same file: the tokenizer rebuilt from the GGUF, and a greedy continuation of a prompt
longer than the 512-token window, which only per-group sliding KV gets right."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import gemma3_270m_hf_dir

from kvflow import LLM, SamplingParams

TEXT = ("The printing press spread across Europe within decades of its invention. Printers in Venice, "
        "Paris and Basel set up shops, and books became cheaper every year; scholars could compare "
        "editions, merchants kept printed tables, and pamphlets carried news from town to town. ") * 12


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("gemma3-270m", dtype="float32", max_model_len=1024, block_size=16, kv_cache_memory_gb=0.05)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gemma3_270m_hf_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(path)


@pytest.mark.slow
def test_tokenizer_from_the_gguf_matches_transformers(llm, hf):
    _, hf_tok = hf
    for text in (TEXT, "  two  spaces\tand tabs\n\nnaïve café — 東京 😀 12345", "<start_of_turn>user\nhi<end_of_turn>"):
        assert llm.get_tokenizer().encode(text) == hf_tok(text)["input_ids"]


@pytest.mark.slow
def test_greedy_continuation_across_the_window_matches_transformers(llm, hf):
    model, _ = hf
    prompt = llm.get_tokenizer().encode(TEXT)
    assert len(prompt) > 512 + 32  # longer than the local layers' window
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, logprobs=0, ignore_eos=True))[0].outputs[0]
    with torch.no_grad():  # logits of the 32 positions that predict the continuation (262k-wide rows)
        ref = model(torch.tensor([prompt + out.token_ids[:-1]]), logits_to_keep=32).logits[0].float().log_softmax(-1)
    assert out.token_ids == ref.argmax(-1).tolist()
    ours = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)])
    torch.testing.assert_close(ours, ref[torch.arange(32), torch.tensor(out.token_ids)], atol=1e-3, rtol=0)


@pytest.mark.slow
def test_it_is_a_base_model_without_a_chat_template(llm):
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
