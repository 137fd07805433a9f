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
from kvflow.engine.llm_engine import LLMEngine, PromptType
from kvflow.engine.outputs import RequestOutput
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
    ) -> list[RequestOutput]:
        """`priority`: one per prompt, lower runs first; used under scheduling_policy="priority"."""
        prompts = _as_prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts))
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts; give one per prompt")
        ids = []
        try:
            for prompt, p, rank in zip(prompts, params, priority):
                ids.append(self.llm_engine.add_request(f"llm-{next(self._ids)}", prompt,
                                                       p.clone(output_kind=RequestOutputKind.FINAL_ONLY), priority=rank))
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
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt, tokenize=True)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

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
