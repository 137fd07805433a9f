"""The step message: workers rebuild exactly the SchedulerOutput the scheduler made, and a decode
step's message stays the same size however long the context is."""

from __future__ import annotations

import pickle

import pytest
import torch
from tiny_models import make_tiny_model

from kvflow import LLM, SamplingParams
from kvflow.worker.step_message import CachedRequestData, NewRequestData, StepDecoder, StepEncoder


def _prompts(lengths, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, 97, (n,), generator=gen).tolist()} for n in lengths]


class RoundTrip:
    """Wraps an executor: every step goes through encode → pickle → decode, and the worker runs
    the rebuilt SchedulerOutput, which must equal the original chunk for chunk."""

    def __init__(self, executor):
        self.executor, self.encoder, self.decoder = executor, StepEncoder(), StepDecoder()
        self.sizes: list[int] = []
        self.kinds: list[str] = []
        self.steps = 0

    def __call__(self, sched):
        wire = pickle.dumps(self.encoder.encode(sched))
        self.sizes.append(len(wire))
        msg = pickle.loads(wire)
        self.kinds.extend(type(r).__name__ for r in msg.requests)
        rebuilt = self.decoder.decode(msg)
        assert rebuilt.chunks == sched.chunks
        assert (rebuilt.swap_in, rebuilt.swap_out, rebuilt.block_copies) == (sched.swap_in, sched.swap_out, sched.block_copies)
        self.steps += 1
        return self.executor.driver_worker.execute_model(rebuilt)


@pytest.mark.parametrize("arch,engine_args", [
    # preemption by recompute, chunked prefill, prefix hits (the repeated prompt)
    ("llama-gqa-llama3-rope", dict(num_kv_blocks=9, block_size=16, max_num_batched_tokens=40)),
    # a window gives blocks back while requests run; swap preemption
    ("mistral-window", dict(num_kv_blocks=8, block_size=4, preemption_mode="swap", swap_space_gb=0.01)),
])
def test_workers_rebuild_every_step_and_outputs_are_unchanged(tmp_path, arch, engine_args):
    make_tiny_model(arch, tmp_path)
    prompts = _prompts([1, 9, 31, 50]) + _prompts([31])  # the last repeats the 3rd: a prefix hit
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                             logprobs=2, prompt_logprobs=1)] * 2 + [SamplingParams(temperature=0, max_tokens=12)]
    results = []
    for wrap in (False, True):
        llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, **engine_args)
        engine = llm.llm_engine
        if wrap:
            trip = RoundTrip(engine.model_executor)
            engine.model_executor.execute_model = trip
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs])
        if wrap:
            stats = engine.get_stats()
            assert stats.num_preemptions_total > 0 and trip.steps > 12
            assert "CachedRequestData" in trip.kinds
            # preempted requests come back as new ones: more "new" entries than requests
            assert trip.kinds.count("NewRequestData") > len(prompts)
    assert results[0] == results[1]


def test_a_decode_step_message_does_not_grow_with_context(tmp_path):
    make_tiny_model("llama-mqa", tmp_path)
    sizes, naive = {}, {}
    for length in (8, 400):
        llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, block_size=16, max_model_len=512)
        trip = RoundTrip(llm.llm_engine.model_executor)
        plain = []

        def step(sched, trip=trip, plain=plain):
            plain.append(len(pickle.dumps(sched)))
            return trip(sched)

        llm.llm_engine.model_executor.execute_model = step
        llm.generate(_prompts([length]), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
        sizes[length], naive[length] = trip.sizes[1:], plain[1:]  # decode steps (step 0 is the prompt)
    # The scheduler's own output carries the whole context each step; the message does not.
    assert min(naive[400]) > max(naive[8]) + 400
    assert max(sizes[400]) - min(sizes[8]) <= 16, (sizes[8], sizes[400])


def test_messages_carry_only_what_changed():
    from kvflow.core.sched_output import ScheduledChunk, SchedulerOutput

    params = SamplingParams(temperature=0, max_tokens=8)
    encoder, decoder = StepEncoder(), StepDecoder()

    def step(start, n, tables, outputs):
        chunk = ScheduledChunk("r", ([5, 6, 7, 8] + outputs)[start:start + n], start, tables, True, params,
                               [5, 6, 7, 8], outputs, frozenset())
        sched = SchedulerOutput()
        sched.add(chunk)
        msg = encoder.encode(sched)
        assert decoder.decode(msg).chunks == [chunk]
        return msg.requests[0]

    first = step(0, 4, ([3],), [])
    assert isinstance(first, NewRequestData)
    second = step(4, 1, ([3, 9],), [11])
    assert isinstance(second, CachedRequestData)
    assert second.new_block_ids == ([9],) and second.new_output_token_ids == [11] and second.nulled == ((),)
    third = step(5, 1, ([-1, 9],), [11, 12])  # the window gave block 3 back
    assert isinstance(third, CachedRequestData) and third.nulled == ((0,),) and third.new_block_ids == ([],)
    fourth = step(6, 1, ([-1, 4],), [11, 12, 13])  # a block replaced (copy-on-write): sent whole again
    assert isinstance(fourth, NewRequestData)


def test_proposals_and_lookahead_travel_in_the_message(tmp_path):
    """Every rank verifies and proposes: a chunk's proposals and how many tokens to propose after it
    are rebuilt exactly (a repetitive prompt makes the n-gram proposer propose)."""
    make_tiny_model("llama-gqa-llama3-rope", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    trip = RoundTrip(llm.llm_engine.model_executor)
    verified = []

    def step(sched):
        verified.append(sum(c.num_spec_tokens for c in sched.chunks))
        return trip(sched)

    llm.llm_engine.model_executor.execute_model = step
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9] * 6}
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert sum(verified) > 0 and "CachedRequestData" in trip.kinds
