"""Engine configuration: small frozen dataclasses, one per concern, built from `EngineArgs`.

`EngineArgs` is the flat, user-facing set of knobs (the keyword arguments of `LLM(...)` and the
CLI's engine flags, named as vLLM names them); `EngineArgs.create_config()` checks them and splits
them into the per-room configs below.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from kvflow.core.kv_eviction import POLICIES as KV_EVICTION_POLICIES
from kvflow.core.kv_eviction import KVEviction
from kvflow.kv_cache_spec import KV_CACHE_DTYPE_CHOICES, QUANTIZED_KV_CACHE_DTYPES
from kvflow.kv_transfer_config import KVOffloadConfig, KVTransferConfig
from kvflow.spec_decode.config import SpeculativeConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_POPULATE_MODES = ("background", "when-idle", "off")
CUSTOM_OPS = ("all", "none")
CPU_WEIGHT_LAYOUTS = ("fast", "compact")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # HF directory, .gguf file, or "" for the embedded default
    dtype: torch.dtype
    load_format: str  # "auto" | "dummy"
    max_model_len: int
    seed: int
    skip_tokenizer_init: bool
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for; -1: no cap
    quantization: str | None = None  # None: the checkpoint as stored (a GGUF's own blocks)
    group_size: int | None = None  # int4/awq: input channels per scale
    quantization_rotation: bool = True  # w4a8/w4a4: rotate the model first (QuaRot)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    kv_cache_memory_gb: float
    num_kv_blocks: int | None  # overrides the memory budget exactly (tests)
    enable_prefix_caching: bool = True
    swap_space_gb: float = 0.0  # host memory for preempted requests' KV (preemption_mode="swap")
    # "auto" (the model's dtype) | "fp8" (= "fp8_e4m3") | "fp8_e5m2" | "int8" (kvflow.attention.kv_quant)
    cache_dtype: str = "auto"
    populate: str = "background"  # when the pool's pages are mapped in: KV_POPULATE_MODES (worker/kv_cache.py)
    # vLLM's: the fraction of the device's memory (the host's on CPU) this engine may hold, the KV
    # pool taking what the loaded model and the activations' headroom leave; replaces kv_cache_memory_gb.
    gpu_memory_utilization: float | None = None
    # Every request's KV budget unless it asks for its own (kvflow.core.kv_eviction).
    kv_eviction_policy: str = "none"
    kv_budget_tokens: int | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    policy: str = "fcfs"  # "fcfs" | "priority"
    preemption_mode: str = "recompute"  # "recompute" | "swap"


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "guidance"  # the grammar library: "guidance" (llguidance) | "xgrammar"
    compile_timeout_s: float = 10.0  # a grammar that takes longer is refused (a 400 from the server)
    # JSON schemas as written: an object schema that names its keys but says nothing of others
    # allows others (JSON Schema's rule), where by default it forbids them (vLLM's default).
    lenient_schemas: bool = False


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int  # adapters resident on the device (slots), and so the most one step can mix
    max_lora_rank: int
    max_cpu_loras: int  # adapters kept in host memory (LRU); evicted ones are read from disk again


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # tcp://host:port where the ranks meet (rank 0 listens); None: this machine, a free port.
    distributed_init_method: str | None = None
    node_rank: int = 0  # this process's rank when the ranks are started by hand (one per node)
    distributed_timeout_s: float = 60.0  # a rank silent this long has failed
    data_parallel_size: int = 1  # engine replicas behind one server (kvflow.engine.dp_async_llm)
    pipeline_parallel_size: int = 1  # the layers split into stages, a rank each (kvflow.distributed.pipeline)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class KernelConfig:
    """Which kernels an engine's model runs where it has a choice, fixed when the model is built
    (the worker builds it in `cpu_extension.kernel_scope`; layers and backends keep what they read
    there). Where a kernel cannot run (no compiler, another CPU, another dtype) its torch code runs
    whatever this says."""

    # kvflow's fused kernels for RMSNorm (+ residual add), RoPE and SiLU·up (C++ on CPU, Triton on
    # CUDA), and the fused SiLU·up of a [gate; up] product; False (`custom_ops="none"`): the torch
    # code they are tested against (model/layers/reference.py), e.g. to check a result against it.
    custom_ops: bool = True
    # CPU decode steps as one flat call of the kernels the modules would call (worker/cpu_decode.py:
    # the same numbers, without the modules around them); False with `enforce_eager`, as CUDA graphs.
    decode_step: bool = True
    # The bf16 layouts kept beside a quantized weight for the products its own kernel is slow at
    # (`cpu_weight_layouts`: CPU_WEIGHT_LAYOUTS); "compact" keeps none (docs/performance-journal.md).
    weight_layouts: str = "fast"
    # Quest-style sparse decode (attention/sparse_decode.py): a decode reads only this many of its KV
    # blocks, chosen by per-block key summaries; None: every block.
    sparse_decode_blocks: int | None = None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    attention_backend: str  # "torch_sdpa" (fast CPU path) | "torch_reference" (the oracle) | "triton" (GPU)
    device: str  # "cpu" | "cuda[:N]", never "auto"
    use_cuda_graphs: bool  # replay decode steps from captured graphs (CUDA + triton only)
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    lora: LoRAConfig | None = None  # None: LoRA disabled
    parallel: ParallelConfig = ParallelConfig()
    speculative: SpeculativeConfig | None = None
    kv_transfer: KVTransferConfig | None = None  # None: no KV moves between engines
    kv_offload: KVOffloadConfig | None = None  # None: no KV offloading tiers
    batch_invariant: bool = False  # model.layers.batch_invariant
    kernels: KernelConfig = KernelConfig()


@dataclass
class EngineArgs:
    model: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_gb: float = 2.0
    gpu_memory_utilization: float | None = None  # vLLM's: a fraction of device memory instead of a KV budget
    enable_chunked_prefill: bool = True  # vLLM's; False: a prompt is never split (the budget grows to max_model_len)
    trust_remote_code: bool = False  # vLLM's; kvflow runs no code from model repositories, so it changes nothing
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    # The offline token budget (`kvflow serve` keeps 1,024 for its first tokens' latency): W1 ran
    # 0-6% faster at 4,096 than at 2,048 in five alternated pairs (median +3.9%), and slower at
    # 8,192 (docs/performance-journal.md, stop 30).
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 128
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    swap_space_gb: float = 4.0
    disable_log_stats: bool = False
    seed: int = 0
    skip_tokenizer_init: bool = False
    attention_backend: str = "auto"  # triton on CUDA, torch_sdpa on CPU
    device: str = "auto"  # cuda when a GPU is visible, else cpu
    enforce_eager: bool = False  # vLLM's name: no CUDA graphs, no CPU decode step (worker/cpu_decode.py)
    batch_invariant: bool = False  # a request's logits bit for bit the same whatever its batch (CPU)
    speculative_config: dict | str | None = None  # {"method": "ngram", "num_speculative_tokens": 4, ...}
    max_logprobs: int = 20  # vLLM's name and default; -1: no cap
    enable_lora: bool = False  # vLLM's LoRA knobs, names and defaults
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    quantization: str | None = None  # int8, int4, fp8, mxfp4, awq, w8a8, bitsandbytes, w4a8, w4a4 (kvflow.quant.registry)
    group_size: int | None = None  # int4/awq/w4a8/w4a4: input channels sharing a scale (32, 64 or 128)
    # w4a8/w4a4: Hadamard-rotate the model before rounding (QuaRot; quant/rotation.py); False: the
    # same bits on the unrotated model, the comparison the method is measured by.
    quantization_rotation: bool = True
    kv_cache_dtype: str = "auto"  # vLLM's name: fp8 (or fp8_e4m3), fp8_e5m2 or int8 stores KV in one byte per number plus scales
    # When the KV pool's pages are mapped in: "background" (from the start, beside the steps: best
    # for a batch job), "when-idle" (only while no step runs: a server's first requests keep both
    # cores; `kvflow serve`'s default), "off" (each page on its first write).
    kv_populate: str = "background"
    # Token eviction (kvflow.core.kv_eviction): "none" or "sink_window" (StreamingLLM's sinks + the
    # recent tokens), each request's KV bounded by kv_budget_tokens; requests may set their own.
    kv_eviction_policy: str = "none"
    kv_budget_tokens: int | None = None
    structured_outputs_backend: str = "auto"  # guidance (llguidance; what auto means) or xgrammar
    structured_outputs_compile_timeout: float = 10.0  # seconds
    structured_outputs_lenient_schemas: bool = False  # keys a JSON schema does not declare stay allowed
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages of consecutive layers, one rank each, batches in flight through them
    distributed_init_method: str | None = None
    node_rank: int = 0
    distributed_timeout_s: float = 60.0
    kv_transfer_config: dict | str | None = None  # {"kv_connector": "SharedStorageConnector", "kv_role": ...}
    # KV offloading (kvflow.kv_store.tiered): vLLM's --kv-offloading-size (GiB of host memory), then
    # LMCache's tiers below it: a local disk directory and its bound, and a shared store (remote_url).
    kv_offloading_size: float | None = None
    kv_offloading_disk_path: str | None = None
    kv_offloading_disk_size: float = 16.0
    kv_offloading_remote_url: str | None = None
    data_parallel_size: int = 1  # replicas, one process each, behind one server
    # vLLM's compilation_config custom_ops, whole: "all" (kvflow's fused RMSNorm, RoPE and SiLU·up
    # kernels) or "none" (their torch code, the reference they are tested against; KernelConfig).
    custom_ops: str = "all"
    # "fast": a quantized weight keeps bf16 layouts beside its codes for the products of more rows
    # than its own kernel is fast at (prefill, batched decode); "compact": only its codes (less
    # memory, slower prompts and batches). CPU_WEIGHT_LAYOUTS; docs/performance-journal.md measures both.
    cpu_weight_layouts: str = "fast"
    # Quest-style sparse decode: every key stays cached, a decode reads only this many KV blocks per
    # KV head, chosen from per-block key min/max (attention/sparse_decode.py). None: all of them.
    sparse_decode_blocks: int | None = None

    @property
    def world_size(self) -> int:
        """Ranks of one engine: tensor-parallel ranks in each of the pipeline's stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def resolve_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        _require(self.device == "cpu" or self.device.startswith("cuda"), "device", "auto, cpu or cuda[:N]")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was asked for, but torch sees no CUDA GPU")
        return self.device

    def resolve_attention_backend(self, device: str) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if device.startswith("cuda") and triton_installed() else "torch_sdpa"

    def resolve_dtype(self, device: str | None = None) -> torch.dtype:
        if self.dtype == "auto":
            # bf16 halves the bytes each decode step reads; it is faster only where the hardware
            # multiplies bf16 natively, otherwise fp32 (emulated bf16 loses on compute).
            return torch.bfloat16 if has_native_bf16(device or self.resolve_device()) else torch.float32
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        return _DTYPES[self.dtype]

    def create_config(self, model_max_len: int) -> EngineConfig:
        """Validate and split; `model_max_len` is the context length the checkpoint declares."""
        max_len = self.max_model_len or model_max_len
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", "a power of two in 1..128")
        _require(max_len >= 1, "max_model_len", ">= 1")
        # Positions past the checkpoint's context have no rotary angles (and were never trained):
        # a longer max_model_len failed in a step, not here (vLLM refuses it too).
        _require(max_len <= model_max_len, "max_model_len",
                 f"<= the model's context of {model_max_len} positions (got {max_len})")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1")
        _require(self.max_num_seqs >= 1, "max_num_seqs", ">= 1")
        _require(self.kv_cache_memory_gb > 0, "kv_cache_memory_gb", "> 0")
        _require(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
                 "gpu_memory_utilization", "in (0, 1]")
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", ">= 1")
        _require(self.load_format in ("auto", "dummy"), "load_format", "auto or dummy")
        _require(self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy", "fcfs or priority")
        _require(self.preemption_mode in ("recompute", "swap"), "preemption_mode", "recompute or swap")
        _require(self.swap_space_gb >= 0, "swap_space_gb", ">= 0")
        _require(self.max_logprobs >= -1, "max_logprobs", ">= 0, or -1 for no cap")
        _require(self.max_loras >= 1, "max_loras", ">= 1")
        _require(self.max_lora_rank >= 1, "max_lora_rank", ">= 1")
        _require(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras, "max_cpu_loras", ">= max_loras")
        _require(
            self.attention_backend in ("auto", "torch_sdpa", "torch_reference", "triton"),
            "attention_backend", "auto, torch_sdpa, torch_reference or triton",
        )
        _require(self.group_size is None or self.group_size in (32, 64, 128), "group_size", "32, 64 or 128")
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size", ">= 1")
        _require(isinstance(self.pipeline_parallel_size, int) and self.pipeline_parallel_size >= 1,
                 "pipeline_parallel_size", "an integer >= 1")
        _require(0 <= self.node_rank < self.world_size, "node_rank",
                 "in [0, tensor_parallel_size x pipeline_parallel_size)")
        _require(self.distributed_timeout_s > 0, "distributed_timeout_s", "> 0")
        _require(isinstance(self.data_parallel_size, int) and self.data_parallel_size >= 1,
                 "data_parallel_size", "an integer >= 1")
        _require(self.kv_cache_dtype in ("auto", *QUANTIZED_KV_CACHE_DTYPES), "kv_cache_dtype", KV_CACHE_DTYPE_CHOICES)
        _require(self.kv_populate in KV_POPULATE_MODES, "kv_populate", ", ".join(KV_POPULATE_MODES))
        _require(self.custom_ops in CUSTOM_OPS, "custom_ops", " or ".join(CUSTOM_OPS))
        _require(self.cpu_weight_layouts in CPU_WEIGHT_LAYOUTS, "cpu_weight_layouts", " or ".join(CPU_WEIGHT_LAYOUTS))
        _require(self.structured_outputs_backend in ("auto", "guidance", "xgrammar"),
                 "structured_outputs_backend", "auto, guidance or xgrammar")
        _require(self.structured_outputs_compile_timeout > 0, "structured_outputs_compile_timeout", "> 0 seconds")
        kv_transfer = KVTransferConfig.parse(self.kv_transfer_config)
        kv_offload = self._kv_offload(kv_transfer)
        self._check_kv_eviction()
        if self.enable_lora and self.quantization in ("w4a8", "w4a4") and self.quantization_rotation:
            raise ValueError(f"enable_lora: adapters add to the residual stream as trained, and quantization="
                             f"{self.quantization!r} rotates it; use --no-quantization-rotation or another method")
        device = self.resolve_device()
        backend = self.resolve_attention_backend(device)
        blocks = self.sparse_decode_blocks
        _require(blocks is None or (isinstance(blocks, int) and not isinstance(blocks, bool) and blocks >= 2),
                 "sparse_decode_blocks", "an integer >= 2 (the blocks a decode reads, its last one included)")
        if self.sparse_decode_blocks is not None and backend not in ("torch_sdpa", "triton"):
            raise ValueError(f"sparse_decode_blocks needs attention_backend torch_sdpa or triton, not {backend}")
        if self.kv_cache_dtype != "auto" and backend == "triton":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype} is not implemented by the triton attention "
                             "backend yet; use kv_cache_dtype=auto or attention_backend=torch_sdpa")
        if self.batch_invariant:
            _check_batch_invariant(self, device, backend)
        if self.pipeline_parallel_size > 1:
            _check_pipeline_parallel(self)
        return EngineConfig(
            model=ModelConfig(
                model=self.model or "",
                dtype=self.resolve_dtype(device),
                load_format=self.load_format,
                max_model_len=max_len,
                seed=self.seed,
                skip_tokenizer_init=self.skip_tokenizer_init,
                max_logprobs=self.max_logprobs,
                quantization=self.quantization,
                group_size=self.group_size,
                quantization_rotation=self.quantization_rotation,
            ),
            cache=CacheConfig(
                self.block_size, self.kv_cache_memory_gb, self.num_kv_blocks, self.enable_prefix_caching,
                self.swap_space_gb if self.preemption_mode == "swap" else 0.0, self.kv_cache_dtype,
                self.kv_populate, self.gpu_memory_utilization, self.kv_eviction_policy, self.kv_budget_tokens,
            ),
            scheduler=SchedulerConfig(
                self.max_num_batched_tokens if self.enable_chunked_prefill else max(self.max_num_batched_tokens, max_len),
                self.max_num_seqs, self.scheduling_policy, self.preemption_mode
            ),
            attention_backend=backend,
            device=device,
            # Graphs remove launch overhead, which only a GPU has; the triton backend is the one
            # whose decode grid is static. LoRA's per-step slot mapping is not captured yet.
            use_cuda_graphs=device.startswith("cuda") and backend == "triton" and not self.enforce_eager
            and not self.enable_lora and self.sparse_decode_blocks is None,
            structured_outputs=StructuredOutputsConfig(
                "guidance" if self.structured_outputs_backend == "auto" else self.structured_outputs_backend,
                self.structured_outputs_compile_timeout,
                self.structured_outputs_lenient_schemas,
            ),
            lora=LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras or self.max_loras)
            if self.enable_lora else None,
            parallel=ParallelConfig(self.tensor_parallel_size, self.distributed_init_method, self.node_rank,
                                    self.distributed_timeout_s, self.data_parallel_size, self.pipeline_parallel_size),
            speculative=SpeculativeConfig.parse(self.speculative_config),
            kv_transfer=kv_transfer,
            kv_offload=kv_offload,
            batch_invariant=self.batch_invariant,
            # The CPU decode step calls the dense kernel itself: sparse decode runs through the modules.
            kernels=KernelConfig(self.custom_ops == "all", not self.enforce_eager and self.sparse_decode_blocks is None,
                                 self.cpu_weight_layouts, self.sparse_decode_blocks),
        )

    def _kv_offload(self, kv_transfer: KVTransferConfig | None) -> KVOffloadConfig | None:
        """The offloading tiers the arguments ask for; what they do not compose with refused by name."""
        offload = KVOffloadConfig.from_args(self.kv_offloading_size, self.kv_offloading_disk_path,
                                            self.kv_offloading_disk_size, self.kv_offloading_remote_url)
        if offload is None:
            return None
        reasons = {
            "kv_transfer_config": (kv_transfer is not None, "an engine has one KV connector; a kv_consumer deletes "
                                   "the blocks its requests used, offloading keeps every block for later requests"),
            "enable_prefix_caching": (not self.enable_prefix_caching, "offloaded blocks are found by the prefix "
                                      "cache's block hashes; turn prefix caching on"),
            "sparse_decode_blocks": (self.sparse_decode_blocks is not None, "loaded blocks would need their key "
                                     "summaries remade, which the runner does only for its own loads"),
        }
        for name, (asked, why) in reasons.items():
            if asked:
                raise ValueError(f"kv_offloading_size with {name}: {why}")
        return offload

    def _check_kv_eviction(self) -> None:
        """The eviction default is one that runs; what it composes with is the engine's to check
        (`LLMEngine._check_eviction_composes`, for the default and for a request's own alike)."""
        if KVEviction.resolve(self.kv_eviction_policy, self.kv_budget_tokens, self.block_size) is None:
            _require(self.kv_budget_tokens is None, "kv_budget_tokens", "unset without a kv_eviction_policy")

    # -- CLI ---------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = EngineArgs()
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
        g.add_argument("--dtype", default=d.dtype, choices=["auto", *_DTYPES])
        g.add_argument("--load-format", default=d.load_format, choices=["auto", "dummy"])
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--block-size", type=int, default=d.block_size)
        g.add_argument("--kv-cache-memory-gb", type=float, default=d.kv_cache_memory_gb)
        g.add_argument("--gpu-memory-utilization", type=float, default=None,
                       help="vLLM's: the fraction of the device's memory (the host's on CPU) the engine may hold; the "
                            "KV pool gets what the model and 1 GiB of headroom leave (instead of --kv-cache-memory-gb)")
        g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                       help="split long prompts into chunks of the token budget (on by default, as vLLM's; --no-...: "
                            "the budget grows to max-model-len, a prompt runs in one step)")
        g.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM command lines; kvflow never runs code from a model repository")
        g.add_argument("--num-kv-blocks", type=int, default=None)
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching)
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
        g.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"])
        g.add_argument("--preemption-mode", default=d.preemption_mode, choices=["recompute", "swap"])
        g.add_argument("--swap-space-gb", "--swap-space", type=float, default=d.swap_space_gb,
                       help="host memory (GiB) for preempted requests' KV with --preemption-mode swap")
        g.add_argument("--disable-log-stats", action="store_true")
        g.add_argument("--seed", type=int, default=d.seed)
        g.add_argument("--skip-tokenizer-init", action="store_true")
        g.add_argument("--attention-backend", default=d.attention_backend,
                       choices=["auto", "torch_sdpa", "torch_reference", "triton"])
        g.add_argument("--device", default=d.device, help="auto (cuda when a GPU is visible), cpu, or cuda[:N]")
        g.add_argument("--enforce-eager", action="store_true",
                       help="decode through the model's modules: no CUDA graphs, no CPU decode step")
        g.add_argument("--batch-invariant", action="store_true",
                       help="every request's logits bit for bit the same whatever else runs beside it (bf16 too), "
                            "at some speed (CPU, dense attention)")
        g.add_argument("--speculative-config", default=None,
                       help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                            '(methods: ngram, draft_model with "model", layer_skip with "num_draft_layers", '
                            'eagle / eagle3 with "model": an EAGLE head)')
        g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                       help="the most logprobs / prompt_logprobs one request may ask for (-1: no cap)")
        g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters over the base model")
        g.add_argument("--max-loras", type=int, default=d.max_loras,
                       help="adapters resident on the device: the most one step can mix")
        g.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank, help="the largest adapter rank accepted")
        g.add_argument("--max-cpu-loras", type=int, default=None,
                       help="adapters kept in host memory (default: --max-loras); others are read from disk again")
        g.add_argument("--quantization", "-q", default=None,
                       help="quantize a float checkpoint at load: int8, int4, fp8, mxfp4, awq, w8a8, bitsandbytes "
                            "(LLM.int8()), w4a8, w4a4 (rotated first, QuaRot) (default: run the checkpoint as stored; a "
                            "GGUF on its own blocks; gptq, compressed-tensors (incl. NVFP4), bitsandbytes 8-bit: such a "
                            "checkpoint, as its config.json already says)")
        g.add_argument("--quantization-rotation", action=argparse.BooleanOptionalAction, default=True,
                       help="w4a8/w4a4: Hadamard-rotate the model before rounding (--no-...: the same bits unrotated)")
        g.add_argument("--group-size", type=int, default=None, help="int4/awq/w4a8/w4a4: input channels per scale (32, 64, 128)")
        g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=["auto", *QUANTIZED_KV_CACHE_DTYPES],
                       help="KV cache storage: auto (the model's dtype), or fp8 (= fp8_e4m3) / fp8_e5m2 / int8 with a "
                            "bfloat16 scale per head and position: ~2x the tokens of bfloat16 in the same memory "
                            "(fp8_e5m2, for vLLM parity, rounds twice as coarsely as fp8)")
        g.add_argument("--kv-eviction-policy", default=d.kv_eviction_policy, choices=KV_EVICTION_POLICIES,
                       help="bound each request's KV to --kv-budget-tokens: sink_window keeps the first tokens and "
                            "the most recent (StreamingLLM); requests may ask for their own")
        g.add_argument("--kv-budget-tokens", type=int, default=None,
                       help="the most KV tokens a request keeps under --kv-eviction-policy")
        g.add_argument("--sparse-decode-blocks", type=int, default=None,
                       help="Quest-style sparse decode: each decode reads only this many KV blocks per KV head, chosen "
                            "by per-block key min/max (first and last always); costs quality (docs/performance.md)")
        g.add_argument("--kv-populate", default=d.kv_populate, choices=KV_POPULATE_MODES,
                       help="when the KV pool's pages are mapped in: background (ahead of the steps' writes, beside "
                            "them), when-idle (the whole pool, only while no step runs; kvflow serve's default), off "
                            "(on first write)")
        g.add_argument("--structured-outputs-backend", default=d.structured_outputs_backend,
                       choices=["auto", "guidance", "xgrammar"], help="grammar library (auto: guidance, i.e. llguidance)")
        g.add_argument("--structured-outputs-lenient-schemas", action="store_true",
                       help="compile JSON schemas as written: an object that names its properties may still add "
                            "others unless it says additionalProperties: false (default: it may not, as vLLM's)")
        g.add_argument("--structured-outputs-compile-timeout", type=float, default=d.structured_outputs_compile_timeout,
                       help="seconds a JSON schema, regex or grammar may take to compile before it is refused")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                       help="split every layer over N ranks (processes), joined by gloo on CPU, NCCL on GPU")
        g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=d.pipeline_parallel_size,
                       help="split the layers into N stages, one rank (process) each, with a batch per stage in flight")
        g.add_argument("--distributed-init-method", default=None,
                       help="tcp://host:port where the ranks meet (rank 0 listens); default: ranks on this machine")
        g.add_argument("--node-rank", type=int, default=d.node_rank,
                       help="this process's rank when ranks are started one per node (0 runs the engine)")
        g.add_argument("--distributed-timeout-s", type=float, default=d.distributed_timeout_s,
                       help="a rank that does not answer for this long has failed")
        g.add_argument("--kv-transfer-config", default=None,
                       help='disaggregated prefill/decode as JSON, e.g. \'{"kv_connector": "SharedStorageConnector", '
                            '"kv_role": "kv_producer"}\' (roles: kv_producer, kv_consumer, kv_both; '
                            'across hosts: "RedisStoreConnector" '
                            'with "kv_connector_extra_config": {"kv_store_url": "redis://HOST:PORT"}, a Redis server)')
        g.add_argument("--kv-offloading-size", type=float, default=None,
                       help="KV offloading (vLLM's flag): GiB of host memory that keeps every computed KV block after "
                            "the pool lets it go; a later prompt with that prefix loads it instead of computing it")
        g.add_argument("--kv-offloading-disk-path", default=None,
                       help="a local directory below the host tier (LMCache's local_disk): blocks host memory evicts "
                            "go there")
        g.add_argument("--kv-offloading-disk-size", type=float, default=d.kv_offloading_disk_size,
                       help="GiB the disk tier may hold (LMCache's max_local_disk_size)")
        g.add_argument("--kv-offloading-remote-url", default=None,
                       help="the last tier (LMCache's remote_url): redis://[:password@]host:port[/db], or the absolute "
                            "path of a directory engines share")
        g.add_argument("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size,
                       help="serve from N engine replicas, one process each, behind one router (kvflow serve)")
        g.add_argument("--custom-ops", default=d.custom_ops, choices=CUSTOM_OPS,
                       help="all: kvflow's fused RMSNorm, RoPE and SiLU·up kernels; none: their torch code (the "
                            "reference they are tested against; slower), e.g. to check a result against it")
        g.add_argument("--cpu-weight-layouts", default=d.cpu_weight_layouts, choices=CPU_WEIGHT_LAYOUTS,
                       help="fast: quantized weights also keep bf16 layouts for prompts and batched decode; "
                            "compact: only their codes (less memory, slower prompts and batches)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def has_native_bf16(device: str) -> bool:
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: stay with the dtype that is fast everywhere
        return False
    return any(f in flags for f in (" avx512_bf16", " amx_bf16", " bf16"))  # x86 AVX-512/AMX, Arm BF16


def triton_installed() -> bool:
    """Whether triton can be imported, without importing it (that takes a second)."""
    return importlib.util.find_spec("triton") is not None


def _check_batch_invariant(args: EngineArgs, device: str, backend: str) -> None:
    """What the batch-invariant mode covers today; the rest is refused by name, not run variant."""
    if device != "cpu":
        raise ValueError("batch_invariant runs on CPU only for now (the GPU kernels pick their tiling by batch)")
    for name, value, allowed in (("attention_backend", backend, "torch_sdpa"),
                                 ("tensor_parallel_size", args.tensor_parallel_size, 1)):
        if value != allowed:
            raise ValueError(f"batch_invariant needs {name}={allowed} for now; got {value!r}")


def _check_pipeline_parallel(args: EngineArgs) -> None:
    """What pipeline parallel composes with today; the rest is refused, each with its reason."""
    reasons = {
        "speculative_config": (args.speculative_config is not None, "the drafter runs beside the last stage's sampler "
                               "and is not split over stages yet"),
        "enable_lora": (args.enable_lora, "adapters are not split over stages yet"),
        "kv_transfer_config": (args.kv_transfer_config is not None, "the connector saves and loads every layer's KV "
                               "on one rank; a stage holds only its layers'"),
        "kv_offloading_size": (args.kv_offloading_size is not None, "the offloading connector saves and loads every "
                               "layer's KV on one rank; a stage holds only its layers'"),
        "data_parallel_size": (args.data_parallel_size > 1, "replicas of a pipeline are not built yet"),
    }
    for name, (asked, why) in reasons.items():
        if asked:
            raise ValueError(f"pipeline_parallel_size={args.pipeline_parallel_size} with {name}: {why}")


def _require(ok: bool, name: str, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}")
