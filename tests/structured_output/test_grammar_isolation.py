"""No request's constraint can harm another's, with the default model and the real libraries:

- a constraint the grammar library gives up on mid-output (a regex past its lexer's limit, a
  schema that nests forever past its parser's) ends that request with finish_reason "error" and
  why, never "stop" with text that does not match; the requests batched with them get exactly
  the tokens they get alone, and no KV block is left behind;
- a request whose mask job is slow sits steps out while the others finish, then completes with
  the tokens it gets alone;
- data parallel: a burst of constraints that take seconds to compile keeps every replica's engine
  stepping (compiles run on the replica's event loop, not its engine thread), so the watchdog kills
  none and a stream in flight finishes.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvflow import LLM, EngineArgs, RequestOutputKind, SamplingParams, StructuredOutputsParams
from kvflow.engine.dp_async_llm import DPAsyncLLM
from kvflow.engine.load_limits import LoadLimits
from kvflow.structured_output import manager as manager_module

pytestmark = pytest.mark.slow

# batch_invariant: a request gets the same tokens in any batch, so "alone" is the oracle.
ENGINE = dict(max_model_len=512, num_kv_blocks=64, block_size=16, disable_log_stats=True, batch_invariant=True)
GIVES_UP = StructuredOutputsParams(regex="(a{2000}){1234}")  # llguidance's lexer gives up after the first token
# Only ever-deeper arrays: no finite output matches; the parser gives up a few brackets in.
NEVER_COMPLETE = StructuredOutputsParams(json={"type": "array", "items": {"$ref": "#"}, "minItems": 1})
CHOICE = StructuredOutputsParams(choice=["Paris", "London", "Rome"])


def greedy(constraint=None, max_tokens=24) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint)


@pytest.fixture(scope="module")
def llm():
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Name a city in Europe."}],
                                                   tokenize=True)


def alone(llm, prompt, params: SamplingParams) -> list[int]:
    [out] = llm.generate([prompt], [params], use_tqdm=False)
    return out.outputs[0].token_ids


def test_a_grammar_that_breaks_ends_with_an_error_and_harms_no_neighbour(llm, prompt):
    params = [greedy(GIVES_UP), greedy(NEVER_COMPLETE, max_tokens=12), greedy(), greedy(CHOICE)]
    outs = [o.outputs[0] for o in llm.generate([prompt] * 4, params, use_tqdm=False)]
    broken, endless, plain, choice = outs
    assert broken.finish_reason == "error"
    assert broken.error.startswith("the regex could not be followed: the grammar library")
    assert endless.finish_reason == "error"
    assert endless.error.startswith("the JSON schema could not be followed: the grammar library gave up")
    assert plain.token_ids == alone(llm, prompt, params[2])
    assert choice.token_ids == alone(llm, prompt, params[3]) and choice.text in ("Paris", "London", "Rome")
    assert llm.llm_engine.kv_cache_usage == 0.0 and not llm.llm_engine.has_unfinished_requests()


@pytest.mark.timeout(300)
def test_a_slow_mask_job_holds_only_its_request(llm, prompt, monkeypatch):
    monkeypatch.setattr(manager_module, "MASK_WAIT_S", 0.01)
    engine = llm.llm_engine
    expected = {rid: alone(llm, prompt, p) for rid, p in
                (("slow", greedy(CHOICE)), ("plain", greedy()), ("choice", greedy(CHOICE, max_tokens=8)))}
    for rid, p in (("slow", greedy(CHOICE)), ("plain", greedy()), ("choice", greedy(CHOICE, max_tokens=8))):
        engine.add_request(rid, {"prompt_token_ids": prompt}, p)
    gate = threading.Event()
    matcher = engine.structured_output._requests["slow"].matcher
    fill = matcher.fill_bitmask
    matcher.fill_bitmask = lambda bitmask, row: (gate.wait(120), fill(bitmask, row))
    produced, steps = {}, 0
    while not {"plain", "choice"} <= produced.keys():  # the slow request's mask never comes meanwhile
        for out in engine.step():
            if out.finished:
                produced[out.request_id] = out.outputs[0].token_ids
        steps += 1
        assert steps < 200
    assert "slow" not in produced and engine.has_unfinished_requests()
    gate.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                produced[out.request_id] = out.outputs[0].token_ids
    assert produced == expected
    assert engine.kv_cache_usage == 0.0


def _gbnf(seed: int, alternatives: int = 50_000) -> StructuredOutputsParams:
    """A grammar that takes the library over a second to compile (and which it gives up on after
    the first token: each of its rows holds more items than its limit)."""
    words = " | ".join(f'"w{seed}x{i}"' for i in range(alternatives))
    return StructuredOutputsParams(grammar=f"root ::= {words}")


@pytest.mark.timeout(600)
def test_data_parallel_replicas_keep_stepping_through_a_burst_of_slow_compiles(prompt):
    limits = LoadLimits(engine_iteration_timeout_s=3.0)
    dp = DPAsyncLLM(EngineArgs(data_parallel_size=2, structured_outputs_compile_timeout=60, **ENGINE), limits)

    async def stream(params: SamplingParams, request_id: str) -> tuple[str | None, int]:
        finish, count = None, 0
        async for out in dp.generate({"prompt_token_ids": prompt}, params, request_id):
            count += len(out.outputs[0].token_ids)
            finish = out.outputs[0].finish_reason
        return finish, count

    async def main():
        victim = asyncio.create_task(stream(SamplingParams(temperature=0, max_tokens=200, ignore_eos=True,
                                                           output_kind=RequestOutputKind.DELTA), "victim"))
        await asyncio.sleep(0.5)  # in flight on its replica
        burst = [stream(SamplingParams(temperature=0, max_tokens=4, structured_outputs=_gbnf(i)), f"g{i}")
                 for i in range(6)]
        return await victim, await asyncio.gather(*burst)

    try:
        (finish, count), burst = asyncio.run(asyncio.wait_for(main(), 500))
        assert (finish, count) == ("length", 200)
        assert all(f in ("error", "stop", "length") for f, _ in burst), burst
        assert dp.is_alive()  # the watchdog killed no replica
    finally:
        dp.shutdown(timeout=10)
