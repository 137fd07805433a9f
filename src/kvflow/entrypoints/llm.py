"""`LLM`: the offline API. Give it prompts, get RequestOutputs back, in order.

    from kvflow import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from kvflow.config import EngineArgs
from kvflow.engine.beam_search import BeamSearches, BeamSearchOutput, BeamSearchParams, step_error, text_decoder
from kvflow.engine.llm_engine import LLMEngine, PromptType
from kvflow.engine.outputs import RequestOutput
from kvflow.lora.request import LoRARequest
from kvflow.model.tokenizer import Tokenizer
from kvflow.sampling_params import RequestOutputKind, SamplingParams

Messages = list[dict]


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.llm_engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.get_tokenizer()

    def reset_prefix_cache(self) -> None:
        self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`priority`: one per prompt, lower runs first; used under scheduling_policy="priority".
        `lora_request`: one adapter for all prompts, or one (or None) per prompt."""
        prompts = _as_prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts))
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts; give one per prompt")
        loras = _loras_per_prompt(lora_request, len(prompts))
        ids = []
        try:
            for prompt, p, rank, lora in zip(prompts, params, priority, loras):
                ids.append(self.llm_engine.add_request(f"llm-{next(self._ids)}", prompt,
                                                       p.clone(output_kind=RequestOutputKind.FINAL_ONLY), priority=rank,
                                                       lora_request=lora))
        except ValueError as e:
            self.llm_engine.abort_request(ids)  # all or nothing: the batch is refused as a whole
            raise ValueError(f"prompt {len(ids)}: {e}") from e
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt, tokenize=True)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """The `params.beam_width` best continuations of each prompt (`kvflow.engine.beam_search`): all
        prompts' beams run together, one step (one token per beam) at a time."""
        prompts = _as_prompt_list(prompts)
        loras = _loras_per_prompt(lora_request, len(prompts))
        engine = self.llm_engine
        searches = BeamSearches(prompts, params, engine.eos_token_ids, engine.config.model.max_model_len)
        with tqdm(total=params.max_tokens, desc="beam search steps", disable=not use_tqdm) as bar:
            while not searches.done:
                step = searches.step_prompts()
                try:
                    outputs = self.generate([p for _, p in step], params.step_params(), use_tqdm=False,
                                            lora_request=[loras[i] for i, _ in step])
                except ValueError as e:
                    raise step_error(params, e) from e
                searches.advance(step, outputs)
                bar.update(1)
        return searches.outputs(text_decoder(engine.tokenizer))

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="requests", disable=not use_tqdm or len(ids) < 2) as bar:
            while self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single list of token ids
    return prompts


def _params_per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; give one, or one per prompt")
    return params


def _loras_per_prompt(lora_request, count: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} LoRA requests for {count} prompts; give one, or one (or None) per prompt")
    return loras
