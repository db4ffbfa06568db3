"""The demo's one table, rendered from :func:`~ap_backend.demo.summarize`'s dict."""

from __future__ import annotations

from typing import Any

__all__ = ["render_table"]


def _kb(n: int) -> str:
    return f"{n:,} B"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"


def render_table(s: dict[str, Any]) -> str:
    """A markdown table of every number in the summary, headed by the options line."""
    o = s["options"]
    rows: list[tuple[str, str]] = []
    for st in s["steps"]:
        rows.append(
            (
                f"step {st['step']} loss eager / compiled",
                f"{st['loss_eager']:.6f} / {st['loss_compiled']:.6f}",
            )
        )
    rows.append(("max grad rel diff (all ranks, steps)", f"{s['max_grad_rel_diff']:.2e}"))
    labels = {
        "first_partition": f"first partition ({s['saved']['first_partition']['partitioner']})",
        "save_all": "SaveAll (backend)",
        "min_cut_ac": "min-cut + AC",
        "min_cut_ac_untagged": "min-cut + AC, no first compile",
        "plain_compile": "plain torch.compile (min-cut)",
    }
    for key, label in labels.items():
        sv = s["saved"][key]
        rows.append((f"saved activations: {label}", f"{sv['count']} ({_kb(sv['bytes'])})"))
    ag = " / ".join(str(s["saved"][k]["all_gather_outputs_saved"]) for k in labels)
    rows.append(("all-gather outputs saved (first / SaveAll / min-cut+AC / untagged / plain)", ag))
    rows.append(("buckets formed (fw + bw)", str(s["buckets_formed"])))
    ep = s.get("expert_parallel")
    if ep:
        rows.append(
            (
                "expert parallelism (experts per rank x ranks, top-k)",
                f"{ep['experts_per_rank']} x {ep['ranks']} = {ep['experts']}, top-{ep['top_k']}",
            )
        )
        rows.append(
            (
                "MoE regions chunked (fw + bw) / MoE layers",
                f"{ep['chunked_regions']} / {ep['moe_layers']}",
            )
        )
        for direction, short in (("forward", "fw"), ("backward", "bw")):
            a = ep[f"all_to_alls_{direction}"]
            rows.append(
                (
                    f"all-to-alls per MoE layer, {short}: before / after chunking (per chunk)",
                    f"{a['before']} / {_num(a['after'])} ({_num(a['per_chunk'])} x "
                    f"{ep['num_chunks']} chunks)",
                )
            )
    c = s["compile_s"]
    rows.append(
        ("compile time: precompile / backend", f"{c['precompile']:.2f} s / {c['backend']:.2f} s")
    )
    rows.append(("first step (incl. lazy backward compile)", f"{c['first_step']:.2f} s"))
    width = max(len(k) for k, _ in rows)
    vwidth = max(len(v) for _, v in rows)
    head = (
        f"ap-backend demo: {o['ranks']} ranks (gloo), {o['layers']} layers, {o['steps']} steps, "
        f"AC {'on' if o['ac'] else 'off'}, bucketing {'on' if o['bucketing'] else 'off'}, "
        f"chunk {'on (MoE, expert parallel)' if o['chunk'] else 'off'}, "
        f"FSDP {'torchtitan SimpleFSDP' if o.get('fsdp') == 'simple' else 'ap model kit'}"
    )
    lines = [head, f"| {'quantity'.ljust(width)} | {'value'.ljust(vwidth)} |"]
    lines.append(f"|{'-' * (width + 2)}|{'-' * (vwidth + 2)}|")
    lines += [f"| {k.ljust(width)} | {v.ljust(vwidth)} |" for k, v in rows]
    return "\n".join(lines)
