"""The models a server answers to: the base model and its LoRA adapters, by name.

A request's `model` field picks one: the base name (or no name) runs the base model, an adapter's
name runs that adapter. `/v1/models` lists them all. With runtime updating allowed
(`--allow-runtime-lora-updating`, or KVFLOW_ALLOW_RUNTIME_LORA_UPDATING=1 as vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING), `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
add and remove adapters while serving; it is off by default because it lets any client make the
server read files from its disk. Each adapter gets a fresh `lora_int_id`, never reused, so an
adapter loaded again under an old name never meets the old one's cached blocks.

What a client can make the server keep is bounded: an adapter's name is at most
`MAX_LORA_NAME_CHARS` printable characters (it is listed, echoed in errors and logged), and the
server serves at most `max_served_loras` adapters by name at once (a load beyond that is refused
until one is unloaded; the engine's own record of an adapter goes with its unload,
`LoRAManager`). What clients see of an adapter is its name: `/v1/models` and errors never show
where the server keeps it.
"""

from __future__ import annotations

import asyncio
import itertools
import json

from starlette.responses import PlainTextResponse

from kvflow.engine.async_llm import AsyncLLM
from kvflow.entrypoints.openai.errors import APIError
from kvflow.entrypoints.openai.protocol import OpenAIBody
from kvflow.entrypoints.openai.responses import ModelCard, ModelList
from kvflow.lora.request import LoRARequest

MAX_LORA_NAME_CHARS = 256
DEFAULT_MAX_SERVED_LORAS = 256  # a few KB each here and in each engine replica; /v1/models lists them all


def lora_name_error(name: str) -> str | None:
    """Why `name` cannot name an adapter (said without echoing it), or None."""
    if not isinstance(name, str):
        return f"is not a string ({type(name).__name__})"
    if not name:
        return "is empty"
    if len(name) > MAX_LORA_NAME_CHARS:
        return f"has {len(name)} characters, more than the {MAX_LORA_NAME_CHARS} allowed"
    unprintable = next((c for c in name if not c.isprintable()), None)
    if unprintable is not None:
        return f"holds a control or other non-printable character (U+{ord(unprintable):04X})"
    return None


class LoadLoRAAdapterRequest(OpenAIBody):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBody):
    lora_name: str
    lora_int_id: int | None = None


def parse_lora_modules(values: list[str] | None) -> list[LoRARequest]:
    """`--lora-modules` entries, `name=path` or JSON `{"name": ..., "path": ...}`, as LoRARequests
    with ids 1, 2, ..."""
    modules = []
    for index, value in enumerate(values or [], start=1):
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                name, path = spec["name"], spec["path"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules {value!r}: a JSON entry needs \"name\" and \"path\" ({e})") from None
            base = spec.get("base_model_name")
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: expected name=path")
            base = None
        if (error := lora_name_error(name)) is not None:
            raise ValueError(f"--lora-modules {value[:MAX_LORA_NAME_CHARS]!r}: the adapter name {error}")
        modules.append(LoRARequest(name, index, path, base))
    names = [m.lora_name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names an adapter twice: {sorted(n for n in names if names.count(n) > 1)[0]!r}")
    return modules


class ServingModels:
    def __init__(self, async_llm: AsyncLLM, base_name: str, lora_modules: list[LoRARequest] = (),
                 max_served_loras: int = DEFAULT_MAX_SERVED_LORAS) -> None:
        self.async_llm = async_llm
        self.base_name = base_name
        self.max_served_loras = max_served_loras
        self._adapters = {m.lora_name: m for m in lora_modules}
        if base_name in self._adapters:
            raise ValueError(f"--lora-modules: adapter name {base_name!r} is the base model's name")
        if len(self._adapters) > max_served_loras:
            raise ValueError(f"--lora-modules names {len(self._adapters)} adapters, more than the {max_served_loras} "
                             "a server serves at once")
        self._ids = itertools.count(max((m.lora_int_id for m in lora_modules), default=0) + 1)
        self._lock = asyncio.Lock()  # one load or unload at a time: a name is checked and taken together

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model)."""
        if model is None or model == self.base_name:
            return None
        if model in self._adapters:
            return self._adapters[model]
        raise APIError(404, f"the model `{model}` does not exist; this server serves: "
                            f"{', '.join([self.base_name, *self._adapters])}", param="model", code="model_not_found")

    def model_list(self) -> ModelList:
        length = self.async_llm.max_model_len
        cards = [ModelCard(id=self.base_name, root=self.base_name, max_model_len=length)]
        # An adapter's root is its name, where vLLM shows its path: clients need not know the disk.
        cards += [ModelCard(id=name, root=name, parent=self.base_name, max_model_len=length)
                  for name in self._adapters]
        return ModelList(data=cards)

    async def load(self, body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        if (error := lora_name_error(name)) is not None:
            raise APIError(400, f"lora_name {error}", param="lora_name")
        async with self._lock:
            if name == self.base_name or name in self._adapters:
                raise APIError(400, f"the model `{name}` is already being served; unload it first", param="lora_name")
            if len(self._adapters) >= self.max_served_loras:
                raise APIError(409, f"this server already serves {len(self._adapters)} LoRA adapters, the most it "
                                    "serves at once; unload one first (POST /v1/unload_lora_adapter)",
                               param="lora_name")
            request = LoRARequest(name, next(self._ids), body.lora_path)
            try:
                await self.async_llm.add_lora(request)
            except ValueError as e:
                # Data-parallel replicas load it each on their own: those that did must forget it.
                await self.async_llm.remove_lora(request.lora_int_id)
                raise APIError(400, str(e), param="lora_path") from None
            self._adapters[name] = request
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        async with self._lock:
            adapter = self._adapters.get(body.lora_name)
            if adapter is None or body.lora_int_id not in (None, adapter.lora_int_id):
                raise APIError(404, f"the LoRA adapter `{body.lora_name}` is not loaded", param="lora_name",
                               code="model_not_found")
            del self._adapters[body.lora_name]  # new requests cannot name it; running ones finish
            await self.async_llm.remove_lora(adapter.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
