"""Speculation together with the other per-request features: LoRA adapters (verification runs the
request's adapter, the proposer need not), structured output (each verified position is masked by
the grammar as it stands after the proposals before it) — greedy output token for token the
non-speculative output — and the combination that is refused (tensor parallel)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from peft_adapters import make_adapter
from tiny_models import make_tiny_model

from kvflow import LLM, LoRARequest, SamplingParams, StructuredOutputsParams

ARCH = "llama-gqa-llama3-rope"


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    directory = tmp_path_factory.mktemp("base")
    hf = make_tiny_model(ARCH, directory)
    adapters = []
    for i in (1, 2):
        adapter_dir = tmp_path_factory.mktemp(f"adapter{i}")
        make_adapter(hf, adapter_dir, seed=i, r=4, lora_alpha=8)
        adapters.append(LoRARequest(f"adapter{i}", i, str(adapter_dir)))
    return str(directory), adapters


@pytest.mark.parametrize("method", ["ngram", "layer_skip", "draft_model"])
def test_lora_batches_speculate_to_the_same_tokens(base_and_adapters, method):
    """The draft model is the base itself: it proposes exactly what the base would say, so the
    request without an adapter accepts every proposal and the adapted ones only some."""
    base_dir, adapters = base_and_adapters
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False,
            **{"ngram": {"prompt_lookup_min": 1}, "layer_skip": {"num_draft_layers": 1},
               "draft_model": {"model": base_dir}}[method]}
    # Repeated token runs give prompt lookup something to propose.
    prompts = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() * 3 for n in (5, 8, 11, 7)]
    per_prompt = [adapters[0], None, adapters[1], adapters[0]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    def run(speculative_config):
        llm = LLM(base_dir, dtype="float32", skip_tokenizer_init=True, enable_lora=True, max_loras=2, max_lora_rank=4,
                  disable_log_stats=True, speculative_config=speculative_config)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=per_prompt, use_tqdm=False)]
        return outputs, llm.llm_engine

    plain, _ = run(None)
    speculative, engine = run(spec)
    assert speculative == plain
    stats = engine.get_stats().spec_decoding
    assert stats.num_drafts > 0  # proposals were verified
    if method == "draft_model":
        assert stats.num_accepted_tokens >= 15  # the base request's (20 tokens) at least
    assert engine.kv_cache_usage == 0.0
    # The adapters changed the outputs: the test would notice verification without them.
    assert plain[0] != plain[1] or plain[2] != plain[1]


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "city", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "city": {"type": "string", "maxLength": 20},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}}}
RECORD = '{"name": "Ada Lovelace", "city": "London", "tags": ["math", "poetry"]}'


@pytest.mark.slow
def test_structured_output_speculates_to_the_same_tokens():
    """Prompts that quote the answer: prompt lookup proposes long runs, some of which the grammar
    refuses (the prompt's free text after the record). Greedy output equals plain decoding and
    validates; proposals were accepted."""
    small = dict(dtype="float32", disable_log_stats=True, max_model_len=512, kv_cache_memory_gb=0.05)
    prompts = [f"Copy this record exactly.\nRecord: {RECORD}\nThe record was: ",
               f"Record: {RECORD}\nAnd again, the same record: ",
               "Write any short sentence about London: "]
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(temperature=0, max_tokens=48,
                             structured_outputs=StructuredOutputsParams(regex=r'\{"name": "[A-Za-z ]{1,20}"')),
              SamplingParams(temperature=0, max_tokens=16)]  # no grammar, in the same batch
    plain = [o.outputs[0] for o in LLM(**small).generate(prompts, params, use_tqdm=False)]
    llm = LLM(**small, speculative_config={"method": "ngram", "num_speculative_tokens": 6, "adaptive": False})
    speculative = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in speculative] == [o.token_ids for o in plain]
    jsonschema.validate(json.loads(speculative[0].text), SCHEMA)
    assert speculative[1].text.startswith('{"name": "')
    stats = llm.llm_engine.get_stats().spec_decoding
    assert stats.num_accepted_tokens > 10
    assert llm.llm_engine.kv_cache_usage == 0.0
