"""Images in the prompt, served: an Idefics3 (SmolVLM's architecture) checkpoint through `LLM`, each
image encoded once and its rows spliced in place of its `<image>` tokens, against transformers'
Idefics3ForConditionalGeneration in float32 (the encoder and processor alone:
tests/model/test_idefics3_vision.py)."""

from __future__ import annotations

import io

import pytest
import torch
from hf_oracle import assert_matches_oracle
from PIL import Image
from tiny_vlm_models import make_tiny_idefics3, png_bytes, tiny_image_processor, tiny_processor

from kvflow import LLM, SamplingParams

GREEDY = dict(temperature=0, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    directory = tmp_path_factory.mktemp("idefics3")
    hf, tokenizer = make_tiny_idefics3(directory)
    tiny_image_processor().save_pretrained(directory)
    return str(directory), hf, tokenizer


def _oracle(hf, tokenizer, text: str, images: list[bytes]):
    """(prompt token ids as transformers' processor makes them, the model over any continuation)."""
    inputs = tiny_processor(tokenizer)(text=[text], images=[[Image.open(io.BytesIO(b)) for b in images]],
                                       return_tensors="pt")

    def forward(input_ids: torch.Tensor):
        return hf(input_ids=input_ids, pixel_values=inputs["pixel_values"],
                  pixel_attention_mask=inputs["pixel_attention_mask"])
    return inputs["input_ids"][0].tolist(), forward


@pytest.mark.parametrize("step_tokens", [16, 2048])
def test_prompts_with_images_match_transformers(tiny_vlm, step_tokens):
    """One image, and two in one prompt, batched together; at 16 tokens a step every image is cut
    across chunks. Every prompt position's and generated token's logprob within 1e-4."""
    directory, hf, tokenizer = tiny_vlm
    llm = LLM(directory, dtype="float32", max_num_batched_tokens=step_tokens, num_kv_blocks=128)
    cases = [("User: look<image> here.\nAssistant:", [png_bytes(45, 70, seed=1)]),
             ("<image>and<image>: same?", [png_bytes(90, 30, seed=2), png_bytes(20, 20, "RGBA", seed=3)])]
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in cases]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10, prompt_logprobs=0, **GREEDY))
    for (text, images), out in zip(cases, outputs):
        ids, oracle = _oracle(hf, tokenizer, text, images)
        assert out.prompt_token_ids == ids
        assert_matches_oracle(oracle, ids, out, 10)


def test_the_prefix_cache_tells_images_apart(tiny_vlm):
    """The same words with another image find nothing cached; the same image again finds its prompt."""
    directory, hf, tokenizer = tiny_vlm
    llm = LLM(directory, dtype="float32", num_kv_blocks=128)
    kv = llm.llm_engine.scheduler.kv_cache
    text, first, second = "Look: <image> what now?", png_bytes(64, 64, seed=4), png_bytes(64, 64, seed=5)
    params = SamplingParams(max_tokens=6, **GREEDY)
    outputs = []
    for image in (first, second, first):
        hits = kv.prefix_cache_hits
        outputs.append(llm.generate([{"prompt": text, "multi_modal_data": {"image": image}}], params)[0])
        outputs[-1].hits = kv.prefix_cache_hits - hits
    assert outputs[1].hits == 0 and outputs[2].hits > 0
    for image, out in zip((first, second, first), outputs):
        ids, oracle = _oracle(hf, tokenizer, text, [image])
        assert_matches_oracle(oracle, ids, out, 6)


@pytest.mark.parametrize(("prompt", "message"), [
    ({"prompt": "two <image> <image>", "multi_modal_data": {"image": b"x"}}, "not a valid image"),
    ({"prompt": "none here", "multi_modal_data": {"image": [png_bytes(8, 8)]}}, "0 <image> placeholders for 1 images"),
    ({"prompt": "<image>", "multi_modal_data": {"video": b""}}, "multi_modal_data must be"),
    ({"prompt": "<image>", "multi_modal_data": {"image": "a path"}}, "image must be an image file's bytes"),
])
def test_bad_images_are_refused_and_harm_nothing(tiny_vlm, prompt, message):
    directory, _, _ = tiny_vlm
    llm = LLM(directory, dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=2))
    assert llm.generate(["still fine"], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids


def test_a_text_model_refuses_images(tmp_path):
    from tiny_models import make_tiny_model, write_tiny_tokenizer

    make_tiny_model("llama-mqa", tmp_path)
    write_tiny_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), num_kv_blocks=16)
    with pytest.raises(ValueError, match="reads no images"):
        llm.generate([{"prompt": "<image>", "multi_modal_data": {"image": png_bytes(8, 8)}}], SamplingParams(max_tokens=2))


def test_image_tokens_and_image_rows_must_agree(tiny_vlm, monkeypatch):
    """Each <image> token takes the next image row: a prompt whose counts differ is refused up front
    (here an image claiming one row more than its tokens), never run on misaligned rows."""
    import dataclasses

    directory, _, _ = tiny_vlm
    llm = LLM(directory, dtype="float32", num_kv_blocks=64)
    images = llm.llm_engine.prompt_images
    expand = images.expand
    monkeypatch.setattr(images, "expand", lambda text, data: (lambda t, found: (t, tuple(
        dataclasses.replace(i, num_tokens=i.num_tokens + 1) for i in found)))(*expand(text, data)))
    with pytest.raises(ValueError, match="<image> tokens where its images stand for"):
        llm.generate([{"prompt": "<image>", "multi_modal_data": {"image": png_bytes(16, 16)}}], SamplingParams(max_tokens=2))
