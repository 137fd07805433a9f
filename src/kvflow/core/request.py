"""A request as the scheduler sees it: token ids, how many have been computed, and its status.

It lives in `core` (not `engine`) because the scheduler owns its lifecycle; the engine only
creates it and reads it back.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.core.block_hash import cache_extra_keys
from kvflow.core.kv_eviction import KVEviction
from kvflow.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvflow.lora.request import LoRARequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # KV freed: recomputed on resumption
    SWAPPED = "swapped"  # KV copied to host memory: copied back on resumption
    # Blocks allocated, its KV being loaded beside the steps (KV offloading's tiers); vLLM's name.
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its output could not go on as asked (a structured-output constraint broke)

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                        RequestStatus.FINISHED_ERROR)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt, processed: its hash (what keys the prefix cache for it), its tiles'
    pixels (a tensor only the worker's encoder reads; opaque here) and the `<image>` tokens it
    stands for in the prompt, in order with the other images'."""

    hash: bytes
    pixel_values: object
    num_tokens: int


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None
    eos_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    # prompt + output, appended in place so the runner can slice it without copying both.
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    priority: int = 0  # lower runs first (priority scheduling)
    arrival_seq: int = 0  # set by the scheduler: the order of arrival, ties broken
    cache_salt: str | None = None  # requests with different salts never share cached blocks
    lora_request: LoRARequest | None = None  # requests with different adapters never share cached blocks
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    block_hashes: list[bytes] = field(default_factory=list)  # of every full block of all_token_ids
    host_blocks: list[int] = field(default_factory=list)  # where its KV waits while SWAPPED
    spec_token_ids: list[int] = field(default_factory=list)  # proposed to follow its last token, not yet verified
    max_chunk_tokens: int = 1 << 62  # set at admission: the largest chunk whose KV blocks fit the pool
    eviction: KVEviction | None = None  # a KV budget (core/kv_eviction.py); None: keeps all its KV
    num_evicted_tokens: int = 0  # positions past the sinks whose KV left: KV index = position - this
    images: tuple[PromptImage, ...] = ()  # the prompt's images, in the order of their `<image>` tokens

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def cache_extra_keys(self) -> tuple:
        return cache_extra_keys(self.cache_salt, self.lora_int_id, tuple(image.hash for image in self.images))

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether its blocks may be found in and added to the prefix cache: not with a KV budget,
        past whose first eviction point the KV is not the full context's."""
        return self.eviction is None

    @property
    def lora_int_id(self) -> int:
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_tokens_allowed(self) -> int:
        """How many more tokens it may produce (max_tokens); max_model_len is never tighter,
        because admission checked prompt + max_tokens against it."""
        return self.max_tokens - self.num_output_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_output_tokens(self, tokens: list[int], max_model_len: int) -> tuple[RequestStatus | None, int]:
        """Append tokens one at a time, up to the first that ends the request, as if each had come
        in a step of its own. Returns that stop (or None) and how many tokens were appended."""
        for i, token in enumerate(tokens):
            self.append_output_token(token)
            status = self.check_stop(max_model_len)
            if status is not None:
                return status, i + 1
        return None, len(tokens)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Token-level stop conditions after a new token; stop *strings* are the detokenizer's job."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
