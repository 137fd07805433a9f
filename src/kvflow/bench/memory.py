"""`kvflow bench memory`: every resident copy of a model's weights by layout, the KV pool, and the
process's resident set.

One weight can be held in several layouts at once (quant/layouts.py: int4 planes, GEMV codes, a
dense bf16 copy, oneDNN-packed copies, panels, gated pairs), and several of them are laid out only
when a product first needs them. So the engine first runs what a server meets (`--prompt-len`
tokens of one prompt, then a batch of `--batch` decodes), then every linear layer reports its
layouts (`LinearBase.layouts`); the model's other tensors count as "weights", the KV pool as
itself. Each is given as allocated (its tensors' bytes), resident in anonymous memory (its pages
in RAM, by mincore: an untouched KV page is never mapped), and mapped from a cache file (the
packed-weights cache, quant/packed_cache.py: clean pages the kernel reclaims under pressure and
shares with its page cache; how many are in RAM is the page cache's business). "other" is the
process's anonymous resident memory less every anonymous byte counted: the interpreter, torch,
activations, allocator slack. The process is one engine's (`tensor_parallel_size` 1).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import mmap
import os
from dataclasses import dataclass

import torch

from kvflow.config import EngineArgs
from kvflow.quant.layouts import LAYOUTS, WEIGHTS
from kvflow.sampling_params import SamplingParams

KV_POOL, OTHER = "KV pool", "other"


@dataclass(frozen=True)
class MemoryWorkload:
    prompt_len: int = 1024  # one prompt's step: products past the panel kernel's 512 rows
    batch: int = 16  # then decodes of this many rows
    output_len: int = 4


def add_memory_parser(subparsers) -> argparse.ArgumentParser:
    d = MemoryWorkload()
    p = subparsers.add_parser("memory", help="bytes of every weight layout, the KV pool and the process RSS")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len, help="the warm-up's prompt (0: no warm-up)")
    p.add_argument("--batch", type=int, default=d.batch, help="the warm-up's decodes at once")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_memory)
    return p


def run_memory(args: argparse.Namespace) -> int:
    from kvflow.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs.from_cli_args(args))
    warm_up(engine, MemoryWorkload(args.prompt_len, args.batch))
    report = measure_memory(engine.runner.model, engine.runner.kv_caches)
    print(json.dumps(report) if args.json else format_report(report, args.model or "the default model"))
    return 0


def warm_up(engine, workload: MemoryWorkload) -> None:
    """A prompt of `prompt_len` tokens, then `batch` requests decoding together: the layouts a
    serving engine lays out on its first steps."""
    if workload.prompt_len <= 0:
        return
    params = SamplingParams(temperature=0, max_tokens=workload.output_len, ignore_eos=True)
    vocab = engine.arch.vocab_size
    prompts = [[(7 * i + 3) % vocab for i in range(workload.prompt_len)]]
    prompts += [[(31 * r + i) % vocab for i in range(8)] for r in range(1, workload.batch + 1)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"memory-{i}", prompt, params)
        if i == 0:  # the long prompt alone first: its own step, of all its rows
            _drain(engine)
    _drain(engine)


def _drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def measure_memory(model: torch.nn.Module, kv_caches: list[torch.Tensor]) -> dict:
    """{"layouts": {name: {"allocated", "anonymous", "file"}: bytes}, "rss": {...}} for this process."""
    from kvflow.model.layers.linear import LinearBase

    seen: set = set()
    files = _file_mappings()
    by_layout = {name: [0, 0, 0] for name in (*LAYOUTS, KV_POOL)}
    for module in model.modules():
        if isinstance(module, LinearBase):
            for name, tensors in module.layouts().items():
                _count(by_layout[name], tensors, seen, files)
    _count(by_layout[WEIGHTS], [*model.parameters(), *model.buffers()], seen, files)
    _count(by_layout[KV_POOL], kv_caches, seen, files)
    rss = process_memory()
    anonymous = sum(sizes[1] for sizes in by_layout.values())
    layouts = {name: dict(zip(("allocated", "anonymous", "file"), sizes)) for name, sizes in by_layout.items()}
    layouts[OTHER] = {"allocated": None, "anonymous": max(rss.get("RssAnon", rss["VmRSS"]) - anonymous, 0), "file": 0}
    return {"layouts": layouts, "rss": rss}


def _count(totals: list[int], tensors, seen: set, files: list[tuple[int, int]]) -> None:
    """Adds each tensor not counted before (by its storage, or itself where it has none) to
    [allocated, resident anonymous, mapped from a file]."""
    for tensor in tensors:
        if tensor is None:
            continue
        key = _storage_key(tensor)
        if key in seen:
            continue
        seen.add(key)
        allocated = tensor.numel() * tensor.element_size()
        totals[0] += allocated
        if key[0] == "opaque":
            totals[1] += allocated
        elif any(start <= key[1] < end for start, end in files):
            totals[2] += allocated
        else:
            totals[1] += resident_bytes(tensor)


def _file_mappings() -> list[tuple[int, int]]:
    """[start, end) of this process's mappings of files (an inode), from /proc/self/maps."""
    found = []
    with open(f"/proc/{os.getpid()}/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[4] != "0":
                start, end = (int(a, 16) for a in fields[0].split("-"))
                found.append((start, end))
    return found


def _storage_key(tensor: torch.Tensor) -> tuple:
    """A tensor's memory: its storage's (views of one share it), or the tensor itself where it has
    none (oneDNN's packed weights: opaque, and written when packed, so all resident)."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return ("opaque", id(tensor))
    return ("storage", storage.data_ptr(), storage.nbytes())


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's storage whose pages are in RAM (mincore), whole pages."""
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0 or tensor.device.type != "cpu":
        return 0
    page = mmap.PAGESIZE
    start = storage.data_ptr() // page * page
    pages = -(-(storage.data_ptr() + storage.nbytes() - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    if _libc().mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) != 0:
        return storage.nbytes()  # not a mapping mincore knows (cannot happen for torch's): count it all
    return min(sum(v & 1 for v in vec) * page, storage.nbytes())


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def process_memory() -> dict[str, int]:
    """This process's resident set from /proc/self/status, in bytes: VmRSS and its anonymous,
    file-backed and shared-memory parts; VmHWM, its peak."""
    wanted = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")
    found = {}
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in wanted:
                found[key] = int(value.split()[0]) * 1024
    return found


def format_report(report: dict, model: str) -> str:
    mib = 2**20
    lines = [f"{model}: memory by layout (MiB)", "| layout | allocated | resident, anonymous | mapped from a file |",
             "|---|---|---|---|"]
    for name, sizes in report["layouts"].items():
        allocated = "" if sizes["allocated"] is None else f"{sizes['allocated'] / mib:.1f}"
        lines.append(f"| {name} | {allocated} | {sizes['anonymous'] / mib:.1f} | {sizes['file'] / mib:.1f} |")
    rss = report["rss"]
    lines.append(f"process RSS {rss['VmRSS'] / mib:.1f} MiB (anonymous {rss.get('RssAnon', 0) / mib:.1f}, "
                 f"file {rss.get('RssFile', 0) / mib:.1f}); peak {rss.get('VmHWM', 0) / mib:.1f} MiB")
    return "\n".join(lines)
