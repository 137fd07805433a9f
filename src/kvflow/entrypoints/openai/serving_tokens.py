"""POST /tokenize and /detokenize, in vLLM's shapes: a prompt (or a chat conversation, through the
model's chat template, tools included) to its token ids, and ids back to text. Clients use them to
count and align prompts (`vllm bench serve`, lm-eval's remote tokenizer) without the model's files.
Tokenizing runs on the server's tokenizer threads, under the same byte bound as a prompt."""

from __future__ import annotations

from pydantic import Field, model_validator

from kvflow.entrypoints.openai.errors import bad_request
from kvflow.entrypoints.openai.protocol import ChatMessage, OpenAIBody
from kvflow.entrypoints.openai.tokenization import PromptTokenizer
from kvflow.entrypoints.openai.tool_calls import ToolFields


class TokenizeRequest(OpenAIBody, ToolFields):
    """`prompt` (a completion's text) or `messages` (a chat conversation), not both."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True  # chat
    add_special_tokens: bool | None = None  # default: True for a prompt, False for a conversation (vLLM's)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class TokenizeResponse(OpenAIBody):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBody):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBody):
    prompt: str


class TokenServing:
    def __init__(self, tokenizer: PromptTokenizer) -> None:
        self.tokenizer = tokenizer

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        try:
            ids = await (self._render(req) if req.messages is not None else
                         self.tokenizer.encode(req.prompt, req.add_special_tokens is not False))
            strs = self._token_strs(ids) if req.return_token_strs else None
        except ValueError as e:  # no tokenizer or template, a conversation the template refuses, too long
            raise bad_request(e) from None
        return TokenizeResponse(count=len(ids), max_model_len=self.tokenizer.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        try:
            return DetokenizeResponse(prompt=await self.tokenizer.decode(req.tokens))
        except ValueError as e:
            raise bad_request(e) from None

    async def _render(self, req: TokenizeRequest) -> list[int]:
        ids = await self.tokenizer.render_conversation(req)
        tokenizer = self.tokenizer.tokenizer
        bos = tokenizer.bos_token_id if tokenizer is not None else None
        if req.add_special_tokens and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def _token_strs(self, ids: list[int]) -> list[str]:
        backend = self.tokenizer.tokenizer.backend
        return [backend.id_to_token(i) or "" for i in ids]
