"""Beam search: keep the `beam_width` most likely continuations of a prompt, a token at a time.

The search follows HF transformers' `generate(num_beams=...)` (the oracle it is tested against):
each step takes the 2 x beam_width best (beam, next token) pairs by cumulative log-probability;
a pair that ends its beam (an end-of-sequence token, or the length limit) becomes a finished
hypothesis if it ranks within the first beam_width, scored by its cumulative log-probability over
(generated length ** length_penalty); the best beam_width pairs that do not end go on. The search
stops when every candidate ends, or when beam_width hypotheses are finished and the best running
beam, scored at its current length, cannot beat the worst of them (HF's default `early_stopping`).
vLLM's beam search differs in two places: it keeps every ended pair among each beam's candidates,
not only those ranked within beam_width, and its length penalty counts the prompt's tokens too.

The engine runs it without knowing: every step is one request per live beam, its prompt the
beam's tokens, asking for one token and the top 2 x beam_width log-probabilities. The paged pool
shares the beams' KV through the prefix cache: a beam's prompt is the prompt of the beam it came
from plus one token, found whole (that prompt's tail block included), so each step computes one
token per beam, and sibling beams writing after the same tail copy that block on write
(`kvflow.core.kv_cache_manager`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from kvflow.engine.outputs import CompletionOutput, PositionLogprobDict, RequestOutput
from kvflow.sampling_params import GREEDY_TEMPERATURE, RequestOutputKind, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's names. Beams are ranked by the model's log-probabilities, so there is no sampling:
    `temperature` must stay 0 (it is here so vLLM code passing it reads the same)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        _check(_is_int(self.beam_width) and self.beam_width >= 1, "beam_width", "an integer >= 1", self.beam_width)
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1", self.max_tokens)
        _check(isinstance(self.temperature, (int, float)) and self.temperature < GREEDY_TEMPERATURE, "temperature",
               "0: beam search ranks beams by the model's log-probabilities and samples nothing", self.temperature)
        _check(isinstance(self.length_penalty, (int, float)) and not isinstance(self.length_penalty, bool)
               and abs(self.length_penalty) <= 100, "length_penalty", "a number in [-100, 100]", self.length_penalty)

    def step_params(self) -> SamplingParams:
        """One step of one beam: its next token's top 2 x beam_width log-probabilities."""
        return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2 * self.beam_width,
                              output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass
class BeamSearchSequence:
    """One finished beam. `tokens`: the prompt's then the generated ones (vLLM's layout);
    `logprobs`: per generated token, the top 2 x beam_width at its position; `text`: the
    generated tokens decoded (an ending EOS left out); `score`: cum_logprob / (generated
    length ** length_penalty), what beams are ranked by (HF's `sequences_scores`)."""

    tokens: list[int]
    logprobs: list[PositionLogprobDict]
    cum_logprob: float
    score: float
    num_prompt_tokens: int
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS token ended it) | "length"
    stop_reason: int | None = None  # the EOS token id that ended it

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # the best first, beam_width of them

    def as_request_output(self, request_id: str, prompt: str | None) -> RequestOutput:
        """The beams as one finished RequestOutput with beam_width completions, best first."""
        first = self.sequences[0]
        outputs = [CompletionOutput(i, s.text or "", s.output_token_ids, s.cum_logprob, None, s.finish_reason,
                                    s.stop_reason) for i, s in enumerate(self.sequences)]
        return RequestOutput(request_id, prompt, first.tokens[:first.num_prompt_tokens], None, outputs, finished=True)


@dataclass
class _Beam:
    tokens: list[int]  # generated so far
    logprobs: list[PositionLogprobDict] = field(default_factory=list)
    cum_logprob: float = 0.0


class BeamSearch:
    """One prompt's search: the running beams and the best finished hypotheses."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: frozenset[int],
                 max_model_len: int) -> None:
        self.prompt = list(prompt_token_ids)
        self.params = params
        self.eos = frozenset() if params.ignore_eos else eos_token_ids
        self.max_new_tokens = min(params.max_tokens, max_model_len - len(self.prompt))
        self.running = [_Beam([])]
        self.finished: list[tuple[float, _Beam]] = []  # (score, beam), best first, at most beam_width
        self.done = self.max_new_tokens < 1

    def prompts(self) -> list[list[int]]:
        """The next step's prompts, one per running beam."""
        return [self.prompt + beam.tokens for beam in self.running]

    def advance(self, positions: list[PositionLogprobDict]) -> None:
        """Take one step: `positions[i]` holds the top log-probabilities after running beam i."""
        width, length = self.params.beam_width, len(self.running[0].tokens) + 1
        last = length >= self.max_new_tokens
        candidates = sorted(((beam.cum_logprob + lp.logprob, i, token)
                             for i, (beam, position) in enumerate(zip(self.running, positions))
                             for token, lp in position.items()), key=lambda c: -c[0])[:2 * width]
        running = []
        for rank, (cum_logprob, i, token) in enumerate(candidates):
            parent = self.running[i]
            child = _Beam(parent.tokens + [token], parent.logprobs + [positions[i]], cum_logprob)
            if last or token in self.eos:
                if rank < width:
                    self._finish(child)
            elif len(running) < width:
                running.append(child)
        self.running = running
        self.done = last or not running or self._cannot_improve(length)

    def _finish(self, beam: _Beam) -> None:
        score = beam.cum_logprob / (len(beam.tokens) ** self.params.length_penalty)
        self.finished.append((score, beam))
        self.finished.sort(key=lambda f: -f[0])
        del self.finished[self.params.beam_width:]

    def _cannot_improve(self, length: int) -> bool:
        if len(self.finished) < self.params.beam_width:
            return False
        best_running = self.running[0].cum_logprob / (length ** self.params.length_penalty)
        return best_running <= self.finished[-1][0]

    def output(self, decode: Callable[[list[int]], str] | None) -> BeamSearchOutput:
        sequences = []
        for score, beam in self.finished:
            ended = bool(beam.tokens) and beam.tokens[-1] in self.eos
            text_ids = beam.tokens[:-1] if ended else beam.tokens
            sequences.append(BeamSearchSequence(
                self.prompt + beam.tokens, beam.logprobs, beam.cum_logprob, score, len(self.prompt),
                decode(text_ids) if decode else None, "stop" if ended else "length",
                beam.tokens[-1] if ended else None))
        return BeamSearchOutput(sequences)


class BeamSearches:
    """Several prompts' searches stepped together: what a driver sends each step, and where the
    answers go. A search starts from the prompt as given (text or ids) and learns its token ids
    from its first step's output."""

    def __init__(self, prompts: list, params: BeamSearchParams, eos_token_ids: frozenset[int],
                 max_model_len: int) -> None:
        self.prompts = prompts
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.searches: list[BeamSearch | None] = [None] * len(prompts)

    @property
    def done(self) -> bool:
        return all(s is not None and s.done for s in self.searches)

    def step_prompts(self) -> list[tuple[int, object]]:
        """(prompt index, prompt) for every running beam of every search not done."""
        return [(i, p) for i, s in enumerate(self.searches)
                for p in ([self.prompts[i]] if s is None else [] if s.done else s.prompts())]

    def advance(self, step: list[tuple[int, object]], outputs: list[RequestOutput]) -> None:
        """Feed back one step: `outputs[k]` answers `step[k]`."""
        positions: dict[int, list[PositionLogprobDict]] = {}
        for (i, _), out in zip(step, outputs):
            if not out.outputs or not out.outputs[0].logprobs:
                reason = out.outputs[0].finish_reason if out.outputs else None
                raise RuntimeError(f"a beam search step ended without a token (finish_reason {reason!r})")
            if self.searches[i] is None:
                self.searches[i] = BeamSearch(out.prompt_token_ids, self.params, self.eos_token_ids, self.max_model_len)
            positions.setdefault(i, []).append(out.outputs[0].logprobs[0])
        for i, position in positions.items():
            search = self.searches[i]
            if not search.done:  # a prompt with no room left to generate is done before its first step
                search.advance(position)

    def outputs(self, decode: Callable[[list[int]], str] | None) -> list[BeamSearchOutput]:
        return [s.output(decode) for s in self.searches]


def text_decoder(tokenizer) -> Callable[[list[int]], str] | None:
    """How a beam's generated tokens become its text (None: no tokenizer, no text)."""
    return None if tokenizer is None else lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def step_error(params: BeamSearchParams, error: ValueError) -> ValueError:
    """A beam step refused by the engine, explained in beam search's terms."""
    return ValueError(f"beam search with beam_width={params.beam_width} asks for {2 * params.beam_width} logprobs "
                      f"per step (2 x beam_width): {error}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}; got {value!r}")


class AsyncBeamSearch:
    """One prompt's search on an async engine client (AsyncLLM or the data-parallel front), its
    steps' requests sent concurrently. `first_step()` runs the first step on its own, so a request
    the engine refuses fails before a server answers anything; `finish()` runs the rest."""

    def __init__(self, client, request_id: str, prompt, params: BeamSearchParams, **request_kwargs) -> None:
        self.client = client
        self.request_id = request_id
        self.params = params
        self.request_kwargs = request_kwargs  # lora_request, cache_salt
        self.searches = BeamSearches([prompt], params, client.eos_token_ids, client.max_model_len)
        self.steps = 0

    async def first_step(self) -> None:
        try:
            await self._step()
        except ValueError as e:
            raise step_error(self.params, e) from e

    async def finish(self) -> BeamSearchOutput:
        while not self.searches.done:
            await self._step()
        return self.searches.outputs(text_decoder(self.client.tokenizer))[0]

    async def _step(self) -> None:
        step = self.searches.step_prompts()
        ids = [f"{self.request_id}-beam{self.steps}-{k}" for k in range(len(step))]
        self.steps += 1
        # Every beam's request ends (one token each) before an error is raised: none is left behind.
        results = await asyncio.gather(*(self._one_token(i, p) for i, (_, p) in zip(ids, step)), return_exceptions=True)
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            raise error
        self.searches.advance(step, results)

    async def _one_token(self, request_id: str, prompt) -> RequestOutput:
        stream = await self.client.add_request(request_id, prompt, self.params.step_params(), **self.request_kwargs)
        try:
            outputs = [out async for out in stream]
        finally:
            stream.close()
        return outputs[-1]
