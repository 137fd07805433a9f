"""OpenAI `image_url` content parts on /v1/chat/completions (and their spellings on /v1/responses
and /v1/messages): a data: URL's image reaches the model as `LLM.generate` gives it (that path is
held to transformers: tests/engine/test_images.py); remote URLs and bad data are 400s naming the
part; a client's literal "<image>" text stays text."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
from live_server import served_engine
from tiny_vlm_models import make_tiny_idefics3, png_bytes, tiny_image_processor

from kvflow import LLM, EngineArgs, SamplingParams

# SmolVLM's shape of template: a message's parts in order, the model's placeholder for an image.
TEMPLATE = ("{% for message in messages %}{{ message['role'] | capitalize }}:"
            "{% if message['content'] is string %} {{ message['content'] }}{% else %}"
            "{% for part in message['content'] %}{% if part['type'] == 'text' %} {{ part['text'] }}"
            "{% else %}<image>{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
            "{% if add_generation_prompt %}Assistant:{% endif %}")


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("idefics3-chat")
    make_tiny_idefics3(directory)
    tiny_image_processor().save_pretrained(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return str(directory)


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_an_image_part_reaches_the_model_as_generate_gives_it(vlm_dir):
    image = png_bytes(50, 40, seed=8)
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is"},
                                             {"type": "image_url", "image_url": {"url": _data_url(image)}},
                                             {"type": "text", "text": "?"}]}]
    with served_engine(EngineArgs(vlm_dir, dtype="float32", num_kv_blocks=64, disable_log_stats=True), "vlm") as (server, _):
        response = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    served = response.json()
    llm = LLM(vlm_dir, dtype="float32", num_kv_blocks=64)
    text = "User: what is<image> ?<end_of_utterance>\nAssistant:"
    direct = llm.generate([{"prompt": text, "multi_modal_data": {"image": image}}],
                          SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert served["choices"][0]["message"]["content"] == direct.outputs[0].text
    assert served["usage"]["prompt_tokens"] == len(direct.prompt_token_ids)


def test_responses_and_messages_images_run_as_the_chat_image_does(vlm_dir):
    """Responses' input_image (a data: URL) and Messages' image block (base64 source) become the
    chat request's image_url part: the same prompt, the same greedy text."""
    image = png_bytes(44, 36, seed=5)
    encoded = base64.b64encode(image).decode()
    chat_parts = [{"type": "text", "text": "what is"}, {"type": "image_url", "image_url": {"url": _data_url(image)}}]
    responses_parts = [{"type": "input_text", "text": "what is"}, {"type": "input_image", "image_url": _data_url(image)}]
    messages_blocks = [{"type": "text", "text": "what is"},
                       {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": encoded}}]
    with served_engine(EngineArgs(vlm_dir, dtype="float32", num_kv_blocks=64, disable_log_stats=True), "vlm") as (server, _):
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": chat_parts}], "max_tokens": 6, "temperature": 0})
        responses = httpx.post(f"{server.url}/v1/responses", timeout=120, json={
            "input": [{"role": "user", "content": responses_parts}], "max_output_tokens": 6, "temperature": 0})
        messages = httpx.post(f"{server.url}/v1/messages", timeout=120, json={
            "model": "vlm", "messages": [{"role": "user", "content": messages_blocks}], "max_tokens": 6,
            "temperature": 0})
        remote = httpx.post(f"{server.url}/v1/messages", timeout=60, json={
            "model": "vlm", "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}]})
    for response in (chat, responses, messages):
        assert response.status_code == 200, response.text
    text = chat.json()["choices"][0]["message"]["content"]
    assert responses.json()["output"][0]["content"][0]["text"] == text
    assert messages.json()["usage"]["input_tokens"] == chat.json()["usage"]["prompt_tokens"]
    assert "".join(b["text"] for b in messages.json()["content"] if b["type"] == "text") == text
    assert remote.status_code == 400 and "must be a data: URL" in remote.text, remote.text


@pytest.mark.parametrize(("part", "message"), [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "must be a data: URL"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}, "does not decode"),
    ({"type": "image_url", "image_url": {"url": _data_url(b"not a png")}}, "not a valid image"),
    ({"type": "input_audio", "input_audio": {"data": ""}}, "must be a string or a list"),
])
def test_bad_image_parts_are_400s_and_the_server_goes_on(vlm_dir, part, message):
    with served_engine(EngineArgs(vlm_dir, dtype="float32", num_kv_blocks=64, disable_log_stats=True), "vlm") as (server, _):
        bad = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}], "max_tokens": 2})
        assert bad.status_code == 400 and message in bad.text, bad.text
        beams = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(
                png_bytes(16, 16))}}]}], "max_tokens": 2, "use_beam_search": True, "n": 2, "temperature": 0})
        assert beams.status_code == 400 and "use_beam_search" in beams.text, beams.text
        fine = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "a literal <image> stays text"}], "max_tokens": 2})
        assert fine.status_code == 200, fine.text


def test_a_clients_image_token_text_cannot_stand_for_an_image(vlm_dir):
    """"<image>" typed by the client beside one real image: by default the prompt then holds two
    placeholders for one image and is refused (nothing runs misaligned); with
    --disallow-special-tokens-in-content it is escaped to plain text and the request runs."""
    from live_server import start_thread

    from kvflow import AsyncLLM
    from kvflow.entrypoints.openai.api_server import build_app

    parts = [{"type": "text", "text": "a forged <image> here"},
             {"type": "image_url", "image_url": {"url": _data_url(png_bytes(30, 30, seed=9))}}]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    engine = AsyncLLM.from_engine_args(EngineArgs(vlm_dir, dtype="float32", num_kv_blocks=64, disable_log_stats=True))
    try:
        for escape, status, text in ((False, 400, "2 <image> tokens for 1 images"), (True, 200, "")):
            server = start_thread(build_app(engine, "vlm", escape_special_tokens=escape))
            try:
                response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json=body)
            finally:
                server.stop()
            assert response.status_code == status and text in response.text, response.text
    finally:
        engine.shutdown()
