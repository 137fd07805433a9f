"""LoRA through the OpenAI server: the `model` field picks the adapter, /v1/models lists base and
adapters, adapters load and unload at runtime only when allowed, and a bad or unknown adapter is
a 4xx naming it. What clients can make the server keep is bounded (adapter names, adapters served
at once), and what they see of an adapter is its name, never where it lies on the server's disk.
A tiny float32 model with a character tokenizer, served in this process."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import start_thread
from peft_adapters import make_adapter
from tiny_models import make_tiny_model, write_tiny_tokenizer

from kvflow import LLM, EngineArgs, LLMEngine, LoRARequest, SamplingParams
from kvflow.engine.async_llm import AsyncLLM
from kvflow.entrypoints.openai.api_server import build_app
from kvflow.entrypoints.openai.errors import APIError
from kvflow.entrypoints.openai.serving_models import (
    MAX_LORA_NAME_CHARS,
    LoadLoRAAdapterRequest,
    ServingModels,
    UnloadLoRAAdapterRequest,
)

P = "/v1/completions"
BODY = {"prompt": "Tell me a story", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("tiny-chat")
    hf = make_tiny_model("llama-gqa-llama3-rope", base)
    write_tiny_tokenizer(base)
    adapters = {}
    for seed, name in enumerate(("a1", "a2", "a3", "too-big"), start=1):
        adapters[name] = tmp_path_factory.mktemp(name)
        make_adapter(hf, adapters[name], seed=seed, r=16 if name == "too-big" else 4)
    return str(base), {k: str(v) for k, v in adapters.items()}


def _serve(dirs, allow_runtime: bool):
    base, adapters = dirs
    engine = LLMEngine(EngineArgs(base, dtype="float32", disable_log_stats=True, enable_lora=True, max_loras=2,
                                  max_lora_rank=8))
    modules = [LoRARequest("a1", 1, adapters["a1"]), LoRARequest("a2", 2, adapters["a2"])]
    for m in modules:
        engine.add_lora(m)
    llm = AsyncLLM(engine)
    return llm, start_thread(build_app(llm, "tiny", lora_modules=modules, allow_runtime_lora_updating=allow_runtime))


@pytest.fixture(scope="module")
def server(dirs):
    llm, live = _serve(dirs, allow_runtime=True)
    yield live.url
    live.stop()
    llm.shutdown()


@pytest.fixture(scope="module")
def offline(dirs):
    """The same completions from LLM, per adapter name (None: the base)."""
    base, adapters = dirs
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8, disable_log_stats=True)
    params = SamplingParams(temperature=0, max_tokens=BODY["max_tokens"], ignore_eos=True)
    ids = {"a1": 1, "a2": 2, "a3": 3}
    return {name: llm.generate(BODY["prompt"], params, use_tqdm=False,
                               lora_request=name and LoRARequest(name, ids[name], adapters[name]))[0].outputs[0].text
            for name in (None, "a1", "a2", "a3")}


def _complete(url: str, model: str | None) -> httpx.Response:
    return httpx.post(url + P, json={**BODY, **({"model": model} if model else {})}, timeout=60)


def test_models_lists_base_and_adapters_without_their_paths(server, dirs):
    response = httpx.get(server + "/v1/models", timeout=10)
    data = response.json()["data"]
    assert [m["id"] for m in data] == ["tiny", "a1", "a2"]
    assert data[1]["parent"] == "tiny" and data[1]["root"] == "a1"
    assert all(path not in response.text for path in dirs[1].values())


def test_model_field_picks_the_adapter_in_a_mixed_batch(server, offline):
    models = [None, "a1", "tiny", "a2", "a1", None]
    with ThreadPoolExecutor(len(models)) as pool:  # concurrent: they share steps
        bodies = [r.json() for r in pool.map(lambda m: _complete(server, m), models)]
    for model, body in zip(models, bodies):
        assert body["model"] == (model or "tiny")
        assert body["choices"][0]["text"] == offline[None if model in (None, "tiny") else model]
    assert len({offline[None], offline["a1"], offline["a2"]}) == 3  # the adapters matter


def test_unknown_model_is_404_naming_what_is_served(server):
    response = _complete(server, "a9")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and "`a9`" in error["message"] and "tiny, a1, a2" in error["message"]


def test_runtime_load_and_unload(server, dirs, offline):
    load, unload = server + "/v1/load_lora_adapter", server + "/v1/unload_lora_adapter"
    assert httpx.post(load, json={"lora_name": "a3", "lora_path": dirs[1]["a3"]}, timeout=30).status_code == 200
    assert _complete(server, "a3").json()["choices"][0]["text"] == offline["a3"]
    assert "a3" in [m["id"] for m in httpx.get(server + "/v1/models", timeout=10).json()["data"]]
    again = httpx.post(load, json={"lora_name": "a3", "lora_path": dirs[1]["a3"]}, timeout=30)
    assert again.status_code == 400 and "already" in again.json()["error"]["message"]
    bad = httpx.post(load, json={"lora_name": "big", "lora_path": dirs[1]["too-big"]}, timeout=30)
    assert bad.status_code == 400 and "LoRA adapter 'big'" in bad.json()["error"]["message"]
    assert "max_lora_rank 8" in bad.json()["error"]["message"]
    assert httpx.post(unload, json={"lora_name": "a3"}, timeout=30).status_code == 200
    assert _complete(server, "a3").status_code == 404
    assert httpx.post(unload, json={"lora_name": "a3"}, timeout=30).status_code == 404
    # Loaded again under the same name: a fresh id, and the same outputs.
    assert httpx.post(load, json={"lora_name": "a3", "lora_path": dirs[1]["a3"]}, timeout=30).status_code == 200
    assert _complete(server, "a3").json()["choices"][0]["text"] == offline["a3"]


def test_runtime_adapter_names_are_short_and_printable(server, dirs):
    load, unload = server + "/v1/load_lora_adapter", server + "/v1/unload_lora_adapter"
    bad = {"n" * 100_000: "has 100000 characters, more than the 256 allowed",
           "bad\nname": "non-printable character (U+000A)", "": "is empty"}
    for name, why in bad.items():
        response = httpx.post(load, json={"lora_name": name, "lora_path": dirs[1]["a3"]}, timeout=30)
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "lora_name" and why in error["message"]
        assert len(response.content) < 1000  # the name is not echoed back
    served = {m["id"] for m in httpx.get(server + "/v1/models", timeout=10).json()["data"]}
    assert not served & set(bad)
    longest = "é" * MAX_LORA_NAME_CHARS
    assert httpx.post(load, json={"lora_name": longest, "lora_path": dirs[1]["a3"]}, timeout=30).status_code == 200
    assert httpx.post(unload, json={"lora_name": longest}, timeout=30).status_code == 200


def test_a_path_the_os_refuses_is_a_400(server):
    """A path longer than the file system takes is an OSError even to stat: a 400, not a 500."""
    response = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "far", "lora_path": "/x" * 3000},
                          timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "lora_path"
    assert "File name too long" in response.json()["error"]["message"]


def test_the_adapters_served_at_once_are_bounded(dirs):
    """Full, a load is a 409 saying to unload one; an unload makes room again; and a load that
    fails takes no place."""
    base, adapters = dirs
    llm = AsyncLLM(LLMEngine(EngineArgs(base, dtype="float32", disable_log_stats=True, enable_lora=True,
                                        max_lora_rank=8)))

    async def scenario():
        models = ServingModels(llm, "tiny", [LoRARequest("a1", 1, adapters["a1"])], max_served_loras=2)
        with pytest.raises(APIError) as failed:
            await models.load(LoadLoRAAdapterRequest(lora_name="big", lora_path=adapters["too-big"]))
        assert failed.value.status == 400
        await models.load(LoadLoRAAdapterRequest(lora_name="a2", lora_path=adapters["a2"]))
        with pytest.raises(APIError) as full:
            await models.load(LoadLoRAAdapterRequest(lora_name="a3", lora_path=adapters["a3"]))
        assert full.value.status == 409 and full.value.param == "lora_name"
        assert "already serves 2 LoRA adapters" in full.value.message and "unload one first" in full.value.message
        await models.unload(UnloadLoRAAdapterRequest(lora_name="a1"))
        await models.load(LoadLoRAAdapterRequest(lora_name="a3", lora_path=adapters["a3"]))
        return [card.id for card in models.model_list().data]

    try:
        assert asyncio.run(scenario()) == ["tiny", "a2", "a3"]
    finally:
        llm.shutdown()


def test_too_many_lora_modules_stop_the_start(dirs):
    modules = [LoRARequest(f"a{i}", i, dirs[1]["a1"]) for i in (1, 2, 3)]
    with pytest.raises(ValueError, match="--lora-modules names 3 adapters, more than the 2 a server serves at once"):
        ServingModels(None, "tiny", modules, max_served_loras=2)


def test_an_error_about_a_served_adapter_does_not_show_its_path(dirs, tmp_path):
    """An adapter evicted from host memory is read from disk again when a request names it; if
    its files are gone, that client gets a 400 naming the adapter, not the operator's path."""
    base, adapters = dirs
    hidden = tmp_path / "operators-secret-place"
    shutil.copytree(adapters["a1"], hidden)
    engine = LLMEngine(EngineArgs(base, dtype="float32", disable_log_stats=True, enable_lora=True, max_loras=1,
                                  max_lora_rank=8))
    modules = [LoRARequest("s1", 1, str(hidden)), LoRARequest("a2", 2, adapters["a2"])]
    for m in modules:
        engine.add_lora(m)  # one adapter in host memory: s1 is evicted by a2
    llm = AsyncLLM(engine)
    live = start_thread(build_app(llm, "tiny", lora_modules=modules))
    try:
        shutil.rmtree(hidden)
        response = _complete(live.url, "s1")
        assert response.status_code == 400 and "LoRA adapter 's1'" in response.json()["error"]["message"]
        assert str(tmp_path) not in response.text
        assert _complete(live.url, "a2").status_code == 200
    finally:
        live.stop()
        llm.shutdown()


def test_runtime_updating_is_off_unless_allowed(dirs):
    llm, live = _serve(dirs, allow_runtime=False)
    try:
        response = httpx.post(live.url + "/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": dirs[1]["a3"]},
                              timeout=30)
        assert response.status_code == 404
    finally:
        live.stop()
        llm.shutdown()


def test_serve_refuses_a_bad_lora_module_at_start(dirs):
    base, adapters = dirs
    cmd = [sys.executable, "-m", "kvflow.entrypoints.cli", "serve", "--model", base, "--dtype", "float32",
           "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"big={adapters['too-big']}", "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "LoRA adapter 'big'" in done.stderr and "above max_lora_rank 8" in done.stderr


def test_lora_modules_parse():
    from kvflow.entrypoints.openai.serving_models import parse_lora_modules

    got = parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}'])
    assert got == [LoRARequest("a", 1, "/x"), LoRARequest("b", 2, "/y", "m")]
    for bad, message in ((["a"], "expected name=path"), (["a=/x", "a=/y"], "twice: 'a'"), (['{"name": "a"}'], "needs"),
                         ([f"{'n' * 300}=/x"], "has 300 characters, more than the 256 allowed"),
                         (['{"name": "a\\tb", "path": "/x"}'], "non-printable character (U+0009)"),
                         (['{"name": 5, "path": "/x"}'], "the adapter name is not a string (int)")):
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_lora_modules(bad)
