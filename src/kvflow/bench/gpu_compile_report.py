"""`kvflow bench gpu-compile`'s report as Markdown tables: one row per compiled kernel and target,
then one per launch and step with its roofline time, ready to paste into docs/performance.md."""

from __future__ import annotations

from typing import Any


def format_report(r: dict[str, Any]) -> str:
    s = r["shapes"]
    windows = ", ".join("full" if w is None else f"window {w}" for w in s["windows"])
    lines = [
        f"## {r['model']} ({r['dtype']}): hidden {s['hidden_size']}, {s['num_heads']} heads / "
        f"{s['num_kv_heads']} KV heads x {s['head_dim']}, intermediate {s['intermediate_size']}, {windows}",
        f"block size {s['block_size']}, max_model_len {s['max_model_len']}, max_num_seqs {s['max_num_seqs']}, "
        f"max_num_batched_tokens {s['max_num_batched_tokens']}, {s['num_kv_blocks']} KV blocks, "
        f"decode context {s['context_len']}",
        "steps: " + "; ".join(f"{st['name']} ({_count(st['requests'], 'request')}, {_count(st['tokens'], 'token')}"
                              f"{', CUDA graph' if st['graph'] else ''})" for st in r["steps"]),
    ]
    for target in r["targets"]:
        rows = [k for k in r["kernels"] if k["arch"] == target["arch"]]
        lines += ["", f"### {target['arch']}: {target['gpu']}, {target['num_sms']} SMs, "
                      f"{target['smem_per_block'] // 1024} KiB shared memory per block", ""]
        lines += _table(
            ["kernel", "steps", "configuration", "regs", "spill B", "stack B", "smem B", "cubin KB", "blocks/SM"],
            [[k["kernel"], ", ".join(k["steps"]), _config(k), str(k["registers"]), str(k["spill_store_bytes"]),
              str(k["stack_bytes"] + k["local_bytes"]), str(k["shared_bytes"]),
              f"{k['cubin_bytes'] / 1000:.1f}", f"{k['blocks_per_sm']} ({k['occupancy_limit']})"] for k in rows])
    archs = [t["arch"] for t in r["targets"]]
    lines += ["", "### One launch, by roofline (compulsory bytes and useful FLOPs; no launch latency)", ""]
    lines += _table(
        ["kernel", "step", "role", "programs", "MB", "MFLOP", *[f"{a} µs" for a in archs], "bound"],
        [[e["kernel"], e["step"], e["role"], str(e["programs"]), f"{e['bytes'] / 1e6:.3f}", f"{e['flops'] / 1e6:.1f}",
          *[f"{e['time'][a]['us']:.2f}" for a in archs], e["time"][archs[0]]["bound"]] for e in r["estimates"]])
    problems = [f"- {k['kernel']} on {k['arch']} ({', '.join(k['steps'])}): {p}"
                for k in r["kernels"] for p in k["problems"]]
    lines += ["", "Problems:" if problems else "No kernel spills registers or exceeds its shared memory.", *problems]
    return "\n".join(lines)


def _config(k: dict[str, Any]) -> str:
    # UPPER_CASE names are the kernel's tl.constexpr parameters; folded arguments (a stride of 1)
    # are specialisation, not configuration.
    chosen = " ".join(f"{n}={v}" for n, v in k["constexprs"].items() if n.isupper())
    return f"{chosen} warps={k['num_warps']} stages={k['num_stages']}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]
