"""Prompts become token ids here, on a small pool of worker threads: never on the event loop
(which serves every other client) nor on the engine thread (which steps every running request).

A text longer than any prompt that could fit in the context is refused by its length in bytes
before it is tokenized (model/token_bound.py), so the most a prompt can cost the pool is the
tokenizing of one context's worth of text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvflow.entrypoints.openai.tool_calls import messages_for_template
from kvflow.model.token_bound import longest_token_bytes
from kvflow.model.tokenizer import Tokenizer

T = TypeVar("T")


class PromptTokenizer:
    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int, workers: int,
                 escape_special_tokens: bool = False, reads_images: bool = False) -> None:
        self.tokenizer = tokenizer
        self.reads_images = reads_images  # a text model's template would choke on image parts
        self.escape_special_tokens = escape_special_tokens  # in chat content: see Tokenizer.apply_chat_template
        self.max_model_len = max_model_len
        longest = longest_token_bytes(tokenizer) if tokenizer is not None else None
        self.max_prompt_bytes = None if longest is None else max_model_len * longest
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvflow-tokenize")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tokenizer = self._require()
        self.check_bytes(text)
        return await self._run(tokenizer.encode, text, add_special_tokens)

    async def decode(self, ids: list[int]) -> str:
        """The text of `ids`; ValueError naming the first id the vocabulary does not have."""
        tokenizer = self._require()
        bad = next((i for i in ids if not 0 <= i < tokenizer.vocab_size), None)
        if bad is not None:
            raise ValueError(f"tokens: {bad} is not a token id of this model (0 to {tokenizer.vocab_size - 1})")
        return await self._run(tokenizer.decode, ids)

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool,
                          tools: list[dict] | None = None) -> list[int]:
        tokenizer = self._require()

        return await self._run(lambda: tokenizer.apply_chat_template(
            messages, add_generation_prompt, tokenize=True, tools=tools,
            escape_special_tokens=self.escape_special_tokens, check_text=self.check_bytes))

    async def render_conversation(self, req) -> list[int]:
        """The token ids of a request's `messages` (and `tools`) through the chat template, as chat
        completions and /tokenize render them (req: a ChatCompletionRequest or TokenizeRequest)."""
        if not self.reads_images and any(m.images() for m in req.messages):
            raise ValueError("messages: image parts need a model that reads images; this one reads text only")
        tools = req.template_tools()
        template = self.tokenizer.chat_template if self.tokenizer is not None else None
        messages = messages_for_template([m.for_template() for m in req.messages], tools, template)
        return await self.render_chat(messages, req.add_generation_prompt, tools)

    def check_bytes(self, text: str) -> None:
        if self.max_prompt_bytes is None or len(text) * 4 <= self.max_prompt_bytes:  # at most 4 bytes a character
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_prompt_bytes:
            raise ValueError(f"the prompt is {size} bytes long: more than fits in max_model_len "
                             f"({self.max_model_len}) tokens, which hold at most {self.max_prompt_bytes} bytes "
                             "of text with this tokenizer")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _require(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this server was started without a tokenizer (--skip-tokenizer-init): "
                             "send prompts as token ids")
        return self.tokenizer

    async def _run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
