"""The worker's verification path with real (tiny, random) models: the first token it emits follows
the target's sampling distribution, as non-speculative sampling does, by the same test as the
model-free one (TV < 0.01 and chi-square at a fixed seed, 2·10⁵ samples).

The target's logits after a context and the draft's come from two HF checkpoints; 2·10⁵ copies of
one request, each with its own proposal drawn from the draft's q, are verified in one call of the
runner's speculator, with the runner's own sampling-batch builder (temperature, top-k, penalties).
"""

from __future__ import annotations

import os

import pytest
import torch
from test_rejection_distribution import _chi_square_p_value
from tiny_models import make_tiny_model

from kvflow import EngineArgs, LLMEngine, SamplingParams
from kvflow.core.runner_output import ModelRunnerOutput
from kvflow.core.sched_output import ScheduledChunk
from kvflow.model.layers.sampler import filter_logits
from kvflow.spec_decode.ngram import NgramProposer
from kvflow.worker.speculator import Speculator

SAMPLES = int(os.environ.get("SAMPLES", 200_000))
PARAMS = SamplingParams(temperature=0.9, top_k=30, repetition_penalty=1.2, max_tokens=8)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target_dir, draft_dir = tmp_path_factory.mktemp("t"), tmp_path_factory.mktemp("d")
    return make_tiny_model("qwen2-bias", target_dir), make_tiny_model("qwen2-bias", draft_dir, seed=1), str(target_dir)


def _sampled_distribution(engine: LLMEngine, logits: torch.Tensor, chunk: ScheduledChunk) -> torch.Tensor:
    """What non-speculative sampling draws from at this position: the runner's own treatment."""
    runner = engine.runner
    batch = runner._sampling_batch([chunk])
    adjusted, _ = runner.sampler.adjust(logits[None], batch)
    return runner.sampler.probs(adjusted, batch)[0]


def _frequencies_match(counts: torch.Tensor, p: torch.Tensor) -> bool:
    tv = 0.5 * (counts / counts.sum() - p).abs().sum()
    return bool(tv < 0.01) and _chi_square_p_value(counts, p) > 1e-3


def test_first_token_follows_the_target_distribution(models):
    target, draft, target_dir = models
    engine = LLMEngine(EngineArgs(target_dir, dtype="float32", skip_tokenizer_init=True, disable_log_stats=True))
    runner = engine.runner
    speculator = Speculator(NgramProposer(1, 1), runner.sampler, runner.device)
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(0, 97, (12,), generator=gen).tolist()
    prompt, output = context[:9], context[9:]  # three outputs so far: the penalty sees them
    with torch.no_grad():
        p_logits = target(torch.tensor([context])).logits[0, -1]
        q = filter_logits(draft(torch.tensor([context])).logits[0, -1:] / 1.3, torch.tensor([40]),
                          torch.tensor([1.0]), torch.tensor([0.0])).softmax(-1)[0]
        # The target's next distribution after each possible proposal (the bonus position).
        after = target(torch.cat([torch.tensor([context] * 97), torch.arange(97)[:, None]], 1)).logits[:, -1]
    drafts = torch.multinomial(q, SAMPLES, replacement=True, generator=gen)
    logits = torch.stack([p_logits.expand(SAMPLES, -1), after[drafts]], dim=1).flatten(0, 1)
    chunks = [ScheduledChunk(f"r{i}", [output[-1], d], 11, [0], True, PARAMS, prompt, output, frozenset(),
                             num_spec_tokens=1) for i, d in enumerate(drafts.tolist())]
    for chunk in chunks:
        speculator._draft_probs[chunk.request_id] = q[None]
    out = ModelRunnerOutput()
    torch.manual_seed(0)
    runner.sampler.generator.manual_seed(1)
    speculator.verify(chunks, logits, runner._sampling_batch, runner._generator, out)
    first = torch.tensor([out.sampled[c.request_id][0] for c in chunks])
    p = _sampled_distribution(engine, p_logits, chunks[0])
    assert _frequencies_match(torch.bincount(first, minlength=97), p)
    # Non-speculative sampling, by the same test: the reference is what the plain sampler draws.
    plain_chunk = ScheduledChunk("plain", [output[-1]], 11, [0], True, PARAMS, prompt, output, frozenset())
    plain = runner.sampler(p_logits.expand(SAMPLES, -1).clone(), runner._sampling_batch([plain_chunk] * SAMPLES))
    assert _frequencies_match(torch.bincount(plain.token_ids, minlength=97), p)
    # And the proposals were not simply copied: q differs from p, and rejections happened.
    assert 0.5 * (q - p).abs().sum() > 0.1
    assert any(len(out.sampled[c.request_id]) == 1 for c in chunks[:100])
