"""`kvflow serve` as a user runs it (a real process on 127.0.0.1, the default model), driven by the
official `openai` client; greedy and seeded outputs are checked against `LLM` in this process.

Both sides run bf16 without prefix caching, so a request alone computes exactly the same batches
in either (a prefix-cache hit or a different batch changes bf16 rounding, and can flip an argmax).
One test stops a server of its own with SIGTERM while a stream is in flight.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import live_server
import openai
import pytest
from live_server import parse_metrics, start_process

from kvflow import LLM, SamplingParams
from kvflow.model.default_model import default_model_path

pytestmark = pytest.mark.slow
own_server = live_server.own_server  # a fixture: pytest finds it by its name here

README = Path(__file__).resolve().parents[2] / "README.md"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time, in a small village,"


SERVE = ["--no-enable-prefix-caching"]


@pytest.fixture(scope="module")
def server():
    proc = start_process(SERVE)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm():
    return LLM(enable_prefix_caching=False, disable_log_stats=True)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_ready_prints_url_and_lists_the_model(server, client):
    assert f"on {server.url}" in server.output
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == [default_model_path().stem]


def test_chat_greedy_equals_llm_chat(client, llm, model):
    got = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=24)
    want = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    choice = got.choices[0]
    assert choice.message.role == "assistant" and choice.index == 0
    assert choice.message.content == want.outputs[0].text and choice.finish_reason == want.outputs[0].finish_reason
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-") and got.model == model
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_chat_stream_equals_non_stream(client, model):
    args = dict(model=model, messages=QUESTION, temperature=0, max_completion_tokens=20)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)


def test_completion_greedy_equals_llm_generate_streamed_or_not(client, llm, model):
    want = llm.generate(STORY, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=model, prompt=STORY, temperature=0, max_tokens=10)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.object == "text_completion" and got.usage.completion_tokens == len(want.token_ids)
    stream = client.completions.create(model=model, prompt=STORY, temperature=0, max_tokens=10, stream=True)
    assert "".join(c.choices[0].text for c in stream) == want.text


def test_completion_prompt_forms_n_and_echo(client, llm, model):
    ids = llm.get_tokenizer().encode(STORY)
    args = dict(model=model, temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
    by_text = client.completions.create(prompt=STORY, **args).choices[0].text
    assert client.completions.create(prompt=ids, **args).choices[0].text == by_text
    batch = client.completions.create(prompt=[ids, ids[:5]], n=2, **args)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text and batch.choices[2].text == batch.choices[3].text
    assert batch.usage.prompt_tokens == len(ids) + 5 and batch.usage.completion_tokens == 4 * 6
    # The same batch with echo: the same completions, each behind its prompt.
    plain = client.completions.create(prompt=[STORY, "Hello"], **args)
    echoed = client.completions.create(prompt=[STORY, "Hello"], echo=True, **args)
    assert [c.text for c in echoed.choices] == [STORY + plain.choices[0].text, "Hello" + plain.choices[1].text]


def test_n2_seeded_sampling_is_reproducible_and_equals_llm(client, llm, model):
    args = dict(model=model, messages=QUESTION, n=2, temperature=1.0, top_p=0.9, seed=1234, max_tokens=10)
    first = client.chat.completions.create(**args)
    again = client.chat.completions.create(**args)
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=1234, max_tokens=10)
    want = llm.chat(QUESTION, params, use_tqdm=False)[0]
    assert [c.message.content for c in first.choices] == [o.text for o in want.outputs]
    other = client.chat.completions.create(**{**args, "seed": 99})
    assert [c.message.content for c in other.choices] != [c.message.content for c in first.choices]


def test_chat_logprobs_and_top_logprobs(client, llm, model):
    got = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=8,
                                         logprobs=True, top_logprobs=3)
    want = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=8, logprobs=3), use_tqdm=False)[0].outputs[0]
    content = got.choices[0].logprobs.content
    assert len(content) == len(want.token_ids)
    for entry, token_id, position in zip(content, want.token_ids, want.logprobs):
        assert entry.logprob == pytest.approx(position[token_id].logprob, abs=1e-4)
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and entry.logprob == pytest.approx(tops[0], abs=1e-6)  # greedy
        assert bytes(entry.bytes).decode() == entry.token
    assert "".join(e.token for e in content).startswith(got.choices[0].message.content[:5])


def test_completion_logprobs_stream_and_whole_agree(client, model):
    args = dict(model=model, prompt=STORY, temperature=0, max_tokens=6, logprobs=2)
    whole = client.completions.create(**args).choices[0].logprobs
    parts = [c.choices[0].logprobs for c in client.completions.create(**args, stream=True) if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == whole.tokens and len(whole.tokens) == 6
    assert [x for p in parts for x in p.token_logprobs] == pytest.approx(whole.token_logprobs)
    assert all(2 <= len(top) <= 3 for top in whole.top_logprobs)  # the top 2, plus the chosen if not among them


def test_stop_strings_and_kvflow_extras(client, llm, model):
    free = client.completions.create(model=model, prompt=STORY, temperature=0, max_tokens=24).choices[0].text
    stop = free.split()[3]  # a word the greedy continuation is sure to reach
    got = client.completions.create(model=model, prompt=STORY, temperature=0, max_tokens=24, stop=[stop, "@@"])
    want = llm.generate(STORY, SamplingParams(temperature=0, max_tokens=24, stop=[stop, "@@"]), use_tqdm=False)[0]
    assert got.choices[0].text == want.outputs[0].text == free[:free.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    forced = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12,
                                            extra_body={"top_k": 1, "ignore_eos": True, "min_tokens": 12,
                                                        "repetition_penalty": 1.1, "min_p": 0.05})
    assert forced.usage.completion_tokens == 12 and forced.choices[0].finish_reason == "length"


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=QUESTION)
    assert info.value.body["code"] == "model_not_found"


def test_metrics_count_exactly(server, client, model):
    before = parse_metrics(httpx.get(f"{server.url}/metrics", timeout=10).text)
    usages = [
        client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=5).usage,
        client.completions.create(model=model, prompt=[STORY, "Hi"], max_tokens=4, n=2, seed=3).usage,
    ]
    stream = client.completions.create(model=model, prompt=STORY, max_tokens=7, stream=True,
                                       stream_options={"include_usage": True})
    usages.append(list(stream)[-1].usage)
    after = parse_metrics(httpx.get(f"{server.url}/metrics", timeout=10).text)

    def moved(name: str) -> float:
        return after[f"kvflow:{name}"] - before[f"kvflow:{name}"]

    assert moved("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert moved("generation_tokens_total") == sum(u.completion_tokens for u in usages)
    engine_requests = 1 + 2 + 1  # one per prompt
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert moved(f"{histogram}_count") == engine_requests
    # Every token after a completion's first is one inter-token gap.
    assert moved("inter_token_latency_seconds_count") == sum(u.completion_tokens for u in usages) - (1 + 4 + 1)
    assert after["kvflow:num_requests_running"] == 0 and after["kvflow:kv_cache_usage_perc"] == 0


def readme_block(language: str, marker: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)
    return next(b for b in blocks if marker in b)


def test_readme_main_command_serves_and_its_examples_work(server):
    assert "kvflow serve" in readme_block("bash", "./scripts/setup.sh && .venv/bin/kvflow")
    script = readme_block("python", "from openai import OpenAI").replace("http://127.0.0.1:8000", server.url)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
    if shutil.which("curl"):
        curl = readme_block("bash", "curl ").replace("http://127.0.0.1:8000", server.url)
        proc = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0 and json.loads(proc.stdout)["choices"][0]["message"]["content"], proc.stderr


def test_sigterm_ends_in_flight_streams_and_exits_zero(own_server):
    server = own_server([*SERVE, "--shutdown-timeout", "1"])
    body = {"prompt": STORY, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]" and "the server is shutting down" in rest[-2]  # an error, not a finish
    assert not any('"finish_reason":"abort"' in line for line in rest)
    # Wait for the exit the SIGTERM above started: stop() would signal again if it is still under
    # way (the stream ends before the process does), and a second SIGTERM cuts the shutdown short.
    assert server.proc.wait(timeout=30) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=5)
