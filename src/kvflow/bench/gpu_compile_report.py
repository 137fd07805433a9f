"""`kvflow bench gpu-compile`'s report as Markdown tables, ready to paste into docs/performance-journal.md:
one row per compiled kernel with each target's resources side by side, then one row per launch
and step with its roofline time, and per step the total over one forward pass."""

from __future__ import annotations

from typing import Any


def format_report(r: dict[str, Any]) -> str:
    s = r["shapes"]
    windows = ", ".join("full" if w is None else f"window {w}" for w in s["windows"])
    archs = [t["arch"] for t in r["targets"]]
    lines = [
        f"## {r['model']} ({r['dtype']}): hidden {s['hidden_size']}, {s['num_heads']} heads / "
        f"{s['num_kv_heads']} KV heads x {s['head_dim']}, intermediate {s['intermediate_size']}, {windows}",
        "",
        f"Engine: block size {s['block_size']}, max_model_len {s['max_model_len']}, max_num_seqs "
        f"{s['max_num_seqs']}, max_num_batched_tokens {s['max_num_batched_tokens']}, {s['num_kv_blocks']} KV "
        f"blocks. Steps: " + "; ".join(
            f"{st['name']} ({_count(st['requests'], 'request')}, {_count(st['tokens'], 'token')}"
            f"{', CUDA graph' if st['graph'] else ''})" for st in r["steps"]) +
        f"; decoding requests have {s['context_len']} tokens of context.",
        "", "Targets: " + "; ".join(f"{t['arch']} = {t['gpu']} ({t['num_sms']} SMs, {t['smem_per_block'] // 1024} KiB "
                                    "shared memory per block)" for t in r["targets"])
        + f"; compiled by triton {r['triton']}.", "",
    ]
    per_arch = ["regs", "spill B", "stack B", "smem B", "cubin KB", "blocks/SM"]
    lines += _table(["kernel", "steps", "configuration", *[f"{a} {c}" for a in archs for c in per_arch]],
                    [[first["kernel"], ", ".join(first["steps"]), _config(first),
                      *[cell for a in archs for cell in _resources(by_arch.get(a))]]
                     for first, by_arch in _variants(r["kernels"])])
    lines += ["", "One launch by the roofline (compulsory bytes, useful FLOPs, no launch latency), and the "
                  "launches like it in one forward pass:", ""]
    lines += _table(
        ["step", "kernel", "role", "programs", "MB", "MFLOP", *[f"{a} µs" for a in archs], "bound", "per forward"],
        [[e["step"], e["kernel"], e["role"], str(e["programs"]), f"{e['bytes'] / 1e6:.3f}", f"{e['flops'] / 1e6:.1f}",
          *[f"{e['time'][a]['us']:.2f}" for a in archs], e["time"][archs[0]]["bound"], str(e["per_forward"])]
         for e in r["estimates"]])
    lines += ["", "Per step, all these launches of one forward pass: " + "; ".join(
        f"{step} " + " / ".join(f"{sum(e['time'][a]['us'] * e['per_forward'] for e in rows):.0f} µs" for a in archs)
        for step, rows in _by_step(r["estimates"]).items()) + f" ({' / '.join(archs)})."]
    problems = [f"- {k['kernel']} on {k['arch']} ({', '.join(k['steps'])}): {p}"
                for k in r["kernels"] for p in k["problems"]]
    lines += ["", "Problems:" if problems else "No kernel spills registers or exceeds its shared memory.", *problems]
    return "\n".join(lines)


def _variants(kernels: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, dict[str, Any]]]]:
    """The compiled kernels grouped by configuration: (its first row, {arch: row})."""
    groups: dict[tuple, tuple[dict[str, Any], dict[str, dict[str, Any]]]] = {}
    for k in kernels:
        key = (k["kernel"], tuple(k["steps"]), repr(k["constexprs"]), k["signature"], k["num_warps"], k["num_stages"])
        groups.setdefault(key, (k, {}))[1][k["arch"]] = k
    return list(groups.values())


def _resources(k: dict[str, Any] | None) -> list[str]:
    if k is None:
        return ["-"] * 6
    return [str(k["registers"]), str(k["spill_store_bytes"]), str(k["stack_bytes"] + k["local_bytes"]),
            str(k["shared_bytes"]), f"{k['cubin_bytes'] / 1000:.1f}", f"{k['blocks_per_sm']} ({k['occupancy_limit']})"]


def _by_step(estimates: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    steps: dict[str, list[dict[str, Any]]] = {}
    for e in estimates:
        steps.setdefault(e["step"], []).append(e)
    return steps


def _config(k: dict[str, Any]) -> str:
    # UPPER_CASE names are the kernel's tl.constexpr parameters; folded arguments (a stride of 1)
    # are specialisation, not configuration.
    chosen = " ".join(f"{n}={v}" for n, v in k["constexprs"].items() if n.isupper())
    return f"{chosen} warps={k['num_warps']} stages={k['num_stages']}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]
