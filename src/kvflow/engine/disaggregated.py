"""Disaggregated prefill/decode: a prefill engine and a decode engine, one request path.

A request first runs on the prefill engine with max_tokens=1: computing its prompt saves the
prompt's KV blocks (all but the last token's) to the shared store under their block hashes
(kv_role "kv_producer"). It then runs on the decode engine with the caller's sampling parameters:
its prefix-cache lookup finds what the decode engine already holds, the connector loads the rest
of the prompt from the store ("kv_consumer"), and the decode engine computes the last prompt token
(it needs that token's logits) and every output token. Outputs equal one engine's.

This class drives both engines in one process (tests, the offline API, `kvflow bench disagg`);
`kvflow serve --kv-transfer-config` runs each engine in its own server.
"""

from __future__ import annotations

import time

from kvflow.core.kv_connector import KVStoreConnector
from kvflow.core.request import Request
from kvflow.engine.llm_engine import LLMEngine, PromptType
from kvflow.engine.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams


class DisaggregatedPrefillDecode:
    def __init__(self, prefill: LLMEngine, decode: LLMEngine) -> None:
        for name, engine, role in (("prefill", prefill, "kv_consumer"), ("decode", decode, "kv_producer")):
            connector = engine.scheduler.kv_connector
            if connector is None or connector.kv_role == role:
                raise ValueError(f"the {name} engine needs kv_transfer_config with kv_role "
                                 f"{'kv_producer' if name == 'prefill' else 'kv_consumer'} (or kv_both)")
        if prefill.scheduler.kv_connector.store.location != decode.scheduler.kv_connector.store.location:
            raise ValueError("the prefill and decode engines must share one KV store (shared_storage_path or "
                             "kv_store_url)")
        self.prefill, self.decode = prefill, decode
        self._store: KVStoreConnector = decode.scheduler.kv_connector
        # Requests whose KV is in the store and that the decode engine has not ended: (prompt ids,
        # cache keys), to delete their blocks from the store if they are aborted before it loads them.
        self._prefilled: dict[str, tuple[list[int], tuple]] = {}
        self._salts: dict[str, str] = {}

    def generate(self, prompts: list[PromptType], params: SamplingParams | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Each prompt's prefill, then every decode; outputs in the prompts' order. Each output's
        metrics: arrival is when its prefill was queued, so TTFT includes prefill and transfer."""
        params = params or SamplingParams()
        ids = [self.add_prefill(None, p, cache_salt=cache_salt) for p in prompts]
        arrivals = {rid: time.monotonic() for rid in ids}
        while self.prefill.has_unfinished_requests():
            self.step_prefill()
        for rid, prompt in zip(ids, prompts):
            self.add_decode(rid, prompt, params, arrivals[rid], cache_salt)
        finished: dict[str, RequestOutput] = {}
        while self.decode.has_unfinished_requests():
            finished.update((o.request_id, o) for o in self.step_decode() if o.finished)
        return [finished[rid] for rid in ids]

    def add_prefill(self, request_id: str | None, prompt: PromptType, cache_salt: str | None = None) -> str:
        """Queue a prompt on the prefill engine; its KV is saved once its prompt is computed."""
        request_id = self.prefill.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0),
                                              cache_salt=cache_salt)
        if cache_salt is not None:
            self._salts[request_id] = cache_salt
        return request_id

    def step_prefill(self) -> list[RequestOutput]:
        """One prefill step; returns the outputs of the requests whose KV is now in the store
        (their metrics say how many bytes were saved, in how long)."""
        done = [out for out in self.prefill.step() if out.finished]
        for out in done:
            probe = Request(out.request_id, out.prompt_token_ids, SamplingParams(), 1, frozenset(),
                            cache_salt=self._salts.pop(out.request_id, None))
            self._prefilled[out.request_id] = (out.prompt_token_ids, probe.cache_extra_keys)
        return done

    def add_decode(self, request_id: str, prompt: PromptType, params: SamplingParams,
                   arrival_time: float | None = None, cache_salt: str | None = None) -> str:
        """Queue a prefilled request on the decode engine with the caller's sampling parameters."""
        return self.decode.add_request(request_id, prompt, params, arrival_time=arrival_time, cache_salt=cache_salt)

    def step_decode(self) -> list[RequestOutput]:
        """One decode step. A request that ends there has deleted its blocks from the store."""
        outputs = self.decode.step()
        for out in outputs:
            if out.finished:
                self._prefilled.pop(out.request_id, None)
        return outputs

    def abort(self, request_id: str) -> None:
        """End a request wherever it is: on the prefill engine, in the store, or on the decode engine."""
        self.prefill.abort_request(request_id)
        self._salts.pop(request_id, None)
        self.decode.abort_request(request_id)
        saved = self._prefilled.pop(request_id, None)
        if saved is not None:  # the decode engine may never have seen it
            self._store.discard(*saved)
