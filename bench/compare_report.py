"""The comparison's table (terminal and Markdown), its JSON, and the concurrency-sweep PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def system_row(name: str, description: str, summary: Optional[dict] = None, *, status: str = "ok",
               start_to_ready_s: Optional[float] = None, extrapolated: bool = False,
               measured_requests: Optional[int] = None, notes: str = "") -> dict:
    """One system's line of the table, from a client/report.py summary (None when skipped or failed)."""
    row = {"system": name, "description": description, "status": status, "notes": notes,
           "start_to_ready_s": start_to_ready_s, "extrapolated": extrapolated,
           "measured_requests": measured_requests}
    if summary is not None:
        def q(key: str, p: str):
            d = summary.get(key)
            return d[p] if d else None

        row.update(num_requests=summary["num_requests"], num_failed=summary["num_failed"],
                   total_time_s=summary["total_time_s"], output_token_throughput=summary["output_token_throughput"],
                   total_output_tokens=summary["total_output_tokens"],
                   num_output_length_mismatch=summary["num_output_length_mismatch"],
                   ttft_p50_s=q("ttft_s", "p50"), ttft_p99_s=q("ttft_s", "p99"),
                   tpot_p50_s=q("tpot_s", "p50"), tpot_p99_s=q("tpot_s", "p99"),
                   e2e_p50_s=q("e2e_s", "p50"), e2e_p99_s=q("e2e_s", "p99"))
        if measured_requests is None:
            row["measured_requests"] = summary["num_requests"]
    return row


def _shared_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(texts: dict[str, dict[int, str]]) -> dict:
    """Per system: requests whose text equals transformers' (hf_serial where run, else hf_static).

    Greedy fp32 outputs can still part ways after many tokens when two near-equal logits swap
    order under different batch shapes; the shared prefix (as a fraction of the reference's
    length) tells such late divergence from early, real disagreement.
    """
    serial = texts.get("hf_serial", {})
    reference = {**texts.get("hf_static", {}), **serial}
    out = {}
    for name, mine in texts.items():
        if name == "hf_serial" or not reference:
            continue
        common = [i for i in mine if i in reference and (name != "hf_static" or i in serial)]
        if common:
            shared = [_shared_prefix(mine[i], reference[i]) / max(len(reference[i]), 1) for i in common]
            out[name] = {"compared": len(common), "identical": sum(mine[i] == reference[i] for i in common),
                         "mean_shared_prefix_fraction": sum(shared) / len(shared)}
    return out


def add_ratios(rows: list[dict]) -> None:
    """`ratio_to_ours` = the system's total time / ours (above 1: ours finished sooner); likewise
    `ratio_to_ours_bf16` against our bfloat16-GEMM run where there is one."""
    for base in ("ours", "ours_bf16"):
        ref = next((r for r in rows if r["system"] == base and r.get("total_time_s")), None)
        for r in rows:
            r[f"ratio_to_{base}"] = (r["total_time_s"] / ref["total_time_s"]) if ref and r.get("total_time_s") else None


def arrival_bound(requests: list[tuple[float, int]], rows: list[dict], per_token_s: Optional[float] = None) -> dict:
    """How fast the replay's own schedule lets any system finish, and so the most it can be ahead of hf_serial.

    `requests`: (send offset, output tokens) per request. No server, however fast, finishes before the
    last send; one that streams a request at `per_token_s` per token at best (ours with one client)
    finishes no sooner than max(send + tokens x per_token_s) over the requests. Each floor caps the ratio
    total time of hf_serial / total time of a system at hf_serial's total over that floor.
    """
    serial = next((r for r in rows if r["system"] == "hf_serial" and r.get("total_time_s")), None)
    last_send = max(send for send, _ in requests)
    out = {"last_send_s": last_send, "per_token_s": per_token_s, "serial_total_s": serial and serial["total_time_s"],
           "serial_extrapolated": bool(serial and serial["extrapolated"])}
    out["max_ratio_vs_serial"] = serial["total_time_s"] / last_send if serial and last_send > 0 else None
    if per_token_s:
        send, tokens = max(requests, key=lambda r: r[0] + r[1] * per_token_s)
        out["floor_s"] = send + tokens * per_token_s
        out["floor_request"] = {"send_offset_s": send, "output_tokens": tokens}
        out["max_ratio_vs_serial_at_per_token"] = serial["total_time_s"] / out["floor_s"] if serial else None
    return out


def arrival_bound_lines(bound: dict) -> str:
    """The arrival bound as Markdown bullets (empty without a serial baseline)."""
    if not bound or bound.get("max_ratio_vs_serial") is None:
        return ""
    mark = "~" if bound["serial_extrapolated"] else ""
    lines = [f"- the replay sends its last request at {bound['last_send_s']:.2f} s: no system finishes sooner, so "
             f"none can be more than {mark}{bound['max_ratio_vs_serial']:.2f}x faster than hf_serial "
             f"({mark}{bound['serial_total_s']:.1f} s) on this replay"]
    if bound.get("floor_s"):
        req = bound["floor_request"]
        lines.append(f"- at our one-client TPOT ({1e3 * bound['per_token_s']:.1f} ms, a request streamed alone), the "
                     f"earliest finish is {bound['floor_s']:.2f} s (the request sent at {req['send_offset_s']:.2f} s "
                     f"with {req['output_tokens']} tokens): at most {mark}{bound['max_ratio_vs_serial_at_per_token']:.2f}x "
                     "hf_serial for a server that streams no faster than ours alone")
    return "\n".join(lines)


def _f(value, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, fmt)


def markdown_table(rows: list[dict]) -> str:
    """The headline table; extrapolated numbers carry a `~` and a note."""
    bf16 = any(r.get("ratio_to_ours_bf16") for r in rows)
    head = ("| system | total time (s) | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | "
            "E2E p50 / p99 (s) | start to ready (s) | total time / ours |" + (" total time / ours_bf16 |" if bf16 else ""))
    lines = [head, "|" + "---|" * (9 if bf16 else 8)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['system']} | {r['status']} | | | | | | |" + (" |" if bf16 else ""))
            continue
        mark = "~" if r["extrapolated"] else ""
        name = r["system"] + (f" (extrapolated from {r['measured_requests']} of {r['num_requests']} requests)"
                              if r["extrapolated"] else "")
        lines.append(
            f"| {name} | {mark}{_f(r['total_time_s'], '.1f')} | {mark}{_f(r['output_token_throughput'], '.1f')} | "
            f"{mark}{_f(r['ttft_p50_s'], '.0f', 1e3)} / {_f(r['ttft_p99_s'], '.0f', 1e3)} | "
            f"{mark}{_f(r['tpot_p50_s'], '.1f', 1e3)} / {_f(r['tpot_p99_s'], '.1f', 1e3)} | "
            f"{mark}{_f(r['e2e_p50_s'], '.1f')} / {_f(r['e2e_p99_s'], '.1f')} | {_f(r['start_to_ready_s'], '.1f')} | "
            f"{mark + _f(r['ratio_to_ours'], '.2f') + 'x' if r['ratio_to_ours'] else '-'} |"
            + (f" {mark + _f(r['ratio_to_ours_bf16'], '.2f') + 'x' if r.get('ratio_to_ours_bf16') else '-'} |"
               if bf16 else ""))
    return "\n".join(lines)


def systems_notes(rows: list[dict]) -> str:
    out = []
    for r in rows:
        extra = f" {r['notes']}" if r.get("notes") else ""
        failed = f" {r['num_failed']} failed." if r.get("num_failed") else ""
        mism = f" {r['num_output_length_mismatch']} wrong output lengths." if r.get("num_output_length_mismatch") else ""
        out.append(f"- **{r['system']}**: {r['description']}.{extra}{failed}{mism}")
    return "\n".join(out)


def sweep_table(levels: list[dict]) -> str:
    lines = ["| clients | requests | output tok/s (all) | output tok/s (all clients busy) | TPOT p50 / p99 (ms) | "
             "TTFT p50 (ms) | failed |", "|" + "---|" * 7]
    for lv in levels:
        tpot, ttft = lv.get("tpot_s") or {}, lv.get("ttft_s") or {}
        lines.append(f"| {lv['concurrency']} | {lv['num_requests']} | {_f(lv['output_token_throughput'], '.1f')} | "
                     f"{_f(lv['steady_output_token_throughput'], '.1f')} | {_f(tpot.get('p50'), '.1f', 1e3)} / "
                     f"{_f(tpot.get('p99'), '.1f', 1e3)} | {_f(ttft.get('p50'), '.0f', 1e3)} | {lv['num_failed']} |")
    return "\n".join(lines)


def machine_section(machine: dict) -> str:
    """GEMM rates, KV bytes per token and the decode step at batch 64, as Markdown bullets."""
    lines = []
    gemm = machine.get("gemm")
    if gemm:
        lines.append(f"- fp32 GEMM rate ({gemm['threads']} threads), best / median of 5: " + "; ".join(
            f"{g['shape']} " + ", ".join(f"{lib} {r['gflops_best']:.1f} / {r['gflops_median']:.1f}"
                                         for lib, r in g.get("by_library", {"aten": g}).items()) + " GFLOPS"
            for g in (gemm["mm_2048"], gemm["decode_linear"], gemm["lm_head"])))
    kv = machine.get("kv")
    if kv:
        lines.append(f"- KV bytes per token: {kv['layers']} layers x 2 x {kv['kv_heads']} KV heads x {kv['head_dim']} "
                     f"x {kv['dtype_bytes']} bytes = {kv['bytes_per_token']} bytes")
    step = machine.get("decode_step")
    if step:
        lines.append(f"- engine KV pool: {step['kv_pool_bytes_per_token_slot']:.0f} bytes per token slot "
                     f"(engine reports {step['engine_kv_bytes_per_token']})")
        util = machine.get("utilisation") or {}
        fl = step["flops"]
        lines.append(
            f"- decode step at batch {step['batch']} (offline Engine, warm, mean context {step['mean_context']:.0f} "
            f"tokens, median of {step['steps']} steps{'' if step['all_steps_full'] else ', NOT all steps full'}): "
            f"{1e3 * step['step_s_median']:.1f} ms; host time (outside the forward) "
            f"{100 * step['host_fraction']:.1f} % of the step")
        if util:
            lines.append(
                f"- decode-step FLOPs: {fl['weights'] / 1e9:.2f} GFLOP in weights (2 x {step['batch']} x "
                f"{fl['weight_params'] / 1e6:.1f} M params incl. the LM head) + {fl['attention'] / 1e9:.2f} GFLOP "
                f"attention -> {util['gflops_weights']:.1f} GFLOPS = **{util['pct_of_mm_2048']:.0f} % of the "
                f"best 2048^3 GEMM rate** ({util.get('pct_of_mm_2048_median', float('nan')):.0f} % of its median; "
                f"{util['pct_of_decode_linear']:.0f} % of the decode-shaped rate; "
                f"{util['pct_of_mm_2048_with_attention']:.0f} % counting attention; fastest step "
                f"{1e3 * step['step_s_min']:.1f} ms = {util['pct_of_mm_2048_best_step']:.0f} %)")
    one = machine.get("one_stream")
    if one:
        bw = one["read_bandwidth"]
        lines.append(
            f"- one stream (offline Engine, {one['tokens']} tokens, {one['tokens_per_step']:.2f} per step): "
            f"{one['ms_per_token_median']:.2f} ms per token (median; best {one['ms_per_token_best']:.2f}); a token reads "
            f"{one['bytes_per_token'] / 1e6:.1f} MB ({one['weight_bytes'] / 1e6:.1f} MB of weights + the KV of "
            f"{one['mean_context']:.0f} tokens of context); memory read rate {bw['gbps_best']:.1f} GB/s "
            f"({bw['threads']} threads) -> {one['bandwidth_bound_ms']:.2f} ms per token at that rate = "
            f"**{one['pct_of_bandwidth']:.0f} % of the bandwidth bound**")
    return "\n".join(lines)


def busy(result: dict) -> bool:
    """More runnable work than our threads could leave room for: other jobs shared the cores."""
    m, threads = result["machine"], result["settings"]["threads"]
    return max(m["load_average_before"], m.get("load_average_after", 0)) > threads + 0.5


def write_markdown(result: dict, path: Path) -> None:
    r = result
    parts = [f"# Comparison: {r['scenario']['name']} ({r['settings']['num_requests']} requests)", "",
             f"Run of {r['created']} on {r['machine']['cpu']}, {r['settings']['threads']} threads; "
             f"load average {r['machine']['load_average_before']:.2f} before, "
             f"{r['machine'].get('load_average_after', 0):.2f} after."
             + (" **The machine was busy: numbers are noisy.**" if busy(r) else ""), "",
             f"`{r['command']}`", "",
             markdown_table(r["rows"]), "", systems_notes(r["rows"]), ""]
    if r.get("agreement"):
        parts += ["Outputs identical to transformers (greedy, same token ids in): " + ", ".join(
            f"{k} {v['identical']}/{v['compared']} (mean shared prefix {100 * v['mean_shared_prefix_fraction']:.0f} %)"
            for k, v in r["agreement"].items()), ""]
    bound = arrival_bound_lines(r.get("arrival_bound") or {})
    if bound:
        parts += ["## What the arrival schedule allows", "", bound, ""]
    if r.get("sweep"):
        parts += ["## Concurrency sweep (ours, closed loop)", "", sweep_table(r["sweep"]), ""]
        if r.get("sweep_png"):
            parts += [f"![sweep]({Path(r['sweep_png']).name})", ""]
    if r.get("machine"):
        parts += ["## Machine and engine limits", "", machine_section(r["machine"]), ""]
    path.write_text("\n".join(parts))


def write_json(result: dict, path: Path) -> None:
    path.write_text(json.dumps(result, indent=1, default=str))


def plot_sweep(levels: list[dict], path: Path, title: str) -> Path:
    """Output throughput and TPOT against concurrency (log2 x axis), side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [lv["concurrency"] for lv in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(xs, [lv["steady_output_token_throughput"] for lv in levels], "o-", label="while all clients busy")
    left.plot(xs, [lv["output_token_throughput"] for lv in levels], "s--", label="whole level (incl. tail)")
    left.set_ylabel("output throughput (tokens/s)")
    for q, style in (("p50", "o-"), ("p99", "^:")):
        right.plot(xs, [1e3 * (lv["tpot_s"] or {}).get(q, float("nan")) for lv in levels], style, label=f"TPOT {q}")
    right.set_ylabel("time per output token (ms)")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrent clients (closed loop)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
