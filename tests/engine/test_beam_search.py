"""Beam search (`LLM.beam_search`) against HF transformers' `generate(num_beams=...)` in float32 on
the same weights, with an end-of-sequence token that ends beams early; and the paged pool's share
of it: each step computes one token per beam, the rest found in the prefix cache (copy-on-write)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import make_tiny_model

from kvflow import LLM, BeamSearchParams, Logprob
from kvflow.engine.beam_search import BeamSearch

WIDTH, STEPS = 4, 8
PROMPTS = ([5, 17, 3], [int(t) for t in torch.arange(20) * 7 % 97])  # within a block; past a block boundary


def _hf_beams(hf, prompt: list[int], eos: int, length_penalty: float) -> list[tuple[list[int], float]]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=WIDTH, num_return_sequences=WIDTH,
                      max_new_tokens=STEPS, do_sample=False, eos_token_id=eos, pad_token_id=eos,
                      length_penalty=length_penalty, early_stopping=False, output_scores=True,
                      return_dict_in_generate=True)
    beams = []
    for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist()):
        generated = seq[len(prompt):]
        end = generated.index(eos) + 1 if eos in generated else len(generated)
        beams.append((generated[:end], score))
    return beams


def _choice(hf, prompt: list[int], rank: int) -> int:
    """The token the first step ranks `rank` (1: the most likely)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1]
    return int(logits.topk(rank).indices[rank - 1])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """`models(rank)`: (hf, LLM, eos) where the end-of-sequence token is the one the first step
    ranks `rank`: within the beam width it ends a beam at once, past it it must not."""
    directory = tmp_path_factory.mktemp("beam")
    hf = make_tiny_model("llama-gqa-llama3-rope", directory)
    built = {}

    def build(rank: int):
        if rank not in built:
            eos = _choice(hf, PROMPTS[0], rank)
            model = tmp_path_factory.mktemp(f"eos{rank}")
            for f in directory.iterdir():
                (model / f.name).write_bytes(f.read_bytes())
            config = json.loads((model / "config.json").read_text())
            (model / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
            built[rank] = hf, LLM(str(model), dtype="float32", skip_tokenizer_init=True), eos
        return built[rank]

    return build


@pytest.fixture
def llm(models):
    return models(3)[1]


@pytest.mark.parametrize(("eos_rank", "length_penalty"), [(3, 1.0), (3, 2.0), (6, 0.0)])
def test_beams_and_scores_match_transformers(models, eos_rank, length_penalty):
    hf, llm, eos = models(eos_rank)
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS, length_penalty=length_penalty)
    outputs = llm.beam_search([list(p) for p in PROMPTS], params)
    ended = 0
    for prompt, out in zip(PROMPTS, outputs):
        expected = _hf_beams(hf, prompt, eos, length_penalty)
        assert [s.output_token_ids for s in out.sequences] == [tokens for tokens, _ in expected]
        assert [s.score for s in out.sequences] == pytest.approx([score for _, score in expected], abs=1e-4)
        for s in out.sequences:
            assert s.tokens[:len(prompt)] == prompt
            assert s.finish_reason == ("stop" if s.output_token_ids[-1] == eos else "length")
            assert s.score == pytest.approx(s.cum_logprob / len(s.output_token_ids) ** length_penalty)
            ended += s.finish_reason == "stop"
    # Within the beam width the end-of-sequence token ends beams; ranked past it, it must not.
    assert ended if eos_rank <= WIDTH else not ended


def test_each_step_computes_one_token_per_beam(llm, monkeypatch):
    llm.reset_prefix_cache()
    stats = llm.llm_engine.get_stats
    before = stats()
    beam_requests = []
    generate = llm.generate
    monkeypatch.setattr(llm, "generate", lambda prompts, *a, **k: beam_requests.extend(prompts) or generate(prompts, *a, **k))
    prompt = PROMPTS[1]
    llm.beam_search([prompt], BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS, ignore_eos=True))
    after = stats()
    computed = (after.prefix_cache_queries_total - before.prefix_cache_queries_total
                - (after.prefix_cache_hits_total - before.prefix_cache_hits_total))
    assert len(beam_requests) == 1 + WIDTH * (STEPS - 1)
    # The prompt once, then one token for every later beam request: each beam found the beam it
    # came from whole, its prompt's partial last block included.
    assert computed == len(prompt) + len(beam_requests) - 1
    assert llm.llm_engine.kv_cache_usage == 0.0  # nothing left held


def test_beam_search_refuses_what_it_cannot_do(llm):
    with pytest.raises(ValueError, match="beam_width must be an integer >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="temperature must be 0"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match=r"beam_width=11 asks for 22 logprobs.*max_logprobs"):
        llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=11, max_tokens=2))
    assert llm.llm_engine.kv_cache_usage == 0.0


def _position(logprobs: dict[int, float]) -> dict[int, Logprob]:
    return {token: Logprob(lp) for token, lp in logprobs.items()}


def test_the_search_stops_once_no_running_beam_can_beat_the_finished():
    search = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=10), frozenset({9}), max_model_len=64)
    search.advance([_position({9: -0.1, 4: -0.2, 5: -3.0, 6: -4.0})])
    assert not search.done and [b.tokens for b in search.running] == [[4], [5]]
    search.advance([_position({9: -0.05, 7: -5.0, 8: -6.0, 3: -7.0}), _position({9: -9.0, 7: -9.5, 8: -9.9, 3: -10.0})])
    # Two finished, the worse scoring -0.25 / 2; the best running beam scores -5.2 / 2 at its
    # length: HF's default early stop ends the search here rather than at max_tokens.
    assert [score for score, _ in search.finished] == pytest.approx([-0.1, -0.125])
    assert search.done
    assert [s.output_token_ids for s in search.output(None).sequences] == [[9], [4, 9]]
