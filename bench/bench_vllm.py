"""Multi-turn GRPO-style rollouts: prefixgym vs a real vLLM (0.32, CPU build), same weights.

Workload: bench_multiturn's (`drive`): `groups` groups of `group_size` episodes,
`turns` turns; token-id prompts built by appending the sampled tokens; a group's first
turn is one request with n = group_size, later turns one request per episode; a turn's
requests are submitted together, then awaited. Replies are `reply_tokens` long (an
end-of-text token can end one earlier on vLLM, which stops there: the sampled count
says).

Peers, on the same weights (each model is written once as a Hugging Face directory, and
every peer loads that directory), interleaved `--repeats` times:
1) prefixgym in this process (`LocalService`, prefix cache on); with `--unpacked` also
   the same with `pack_weights=False` (`F.linear` on the weights as they are, what
   sampled before oneDNN's packed weights: `engine/model/packed.py`);
2) `prefixgym serve` over HTTP, through the same client as 3);
3) vLLM over HTTP (`.venv-vllm`, started by `prefixgym.serving.launch` with prefix
   caching, block size 32 and OpenMP threads bound to `--cores`).
Every peer gets `--kv-gib` of KV memory (vLLM's KV cache, our KV pool); the caches
stay warm across repeats, for every peer alike.
Each line gives wall seconds, prompt tokens, prompt tokens computed (vLLM: its own
`/metrics` counters, which count each of a request's n samples; ours: the answers'
usage), the theoretical minimum (every distinct prompt position once), and wall
ratios vLLM / ours (above 1: ours is faster).

    .venv/bin/python bench/bench_vllm.py --models tiny small llama100m --quick
    .venv/bin/python bench/bench_vllm.py --models tiny --repeats 3
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import tempfile
from pathlib import Path

import common
import httpx
from bench_multiturn import (
    RunResult,
    Workload,
    add_workload_flags,
    drive,
    theoretical_min_prefill,
    workload_from,
)

from prefixgym.engine.model import PRESETS, ModelConfig
from prefixgym.local_service import LocalService
from prefixgym.serving.launch import ServerProcess, VLLMLaunch, find_vllm_python, free_port
from prefixgym.serving.openai_client import OpenAISamplingClient

ROOT = Path(__file__).resolve().parents[1]
LLAMA_100M = ModelConfig(vocab_size=4096, dim=768, n_layers=12, n_heads=12, n_kv_heads=4,
                         hidden_dim=2048, max_seq_len=2048)
"""~92M parameters: a Llama shape of a size people RL-train on a CPU at most."""


def model_config(name: str) -> str | ModelConfig:
    return LLAMA_100M if name == "llama100m" else name


def vllm_counters(url: str) -> dict[str, float]:
    """vLLM's cumulative prompt, cached-prompt and generated token counters."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = {}
    for name in ("prompt_tokens", "prompt_tokens_cached", "generation_tokens"):
        match = re.search(rf"^vllm:{name}_total(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        found[name] = float(match.group(1)) if match else float("nan")
    return found


def over_http(url: str, model: str, tokenizer, w: Workload) -> RunResult:  # type: ignore[no-untyped-def]
    with OpenAISamplingClient(url, model=model, max_concurrency=512) as client:
        return drive(client, tokenizer, w)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny"],
                        help=f"presets ({', '.join(PRESETS)}) or llama100m")
    add_workload_flags(parser)
    parser.add_argument("--threads", type=int, default=2, help="ours: torch threads")
    parser.add_argument("--cores", default="0-1", help="vLLM: VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-gib", type=int, default=1,
                        help="KV memory of every peer (vLLM's, and our KV pool's), in GiB")
    parser.add_argument("--unpacked", action="store_true",
                        help="also run ours in process with pack_weights=False")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    args = parser.parse_args()
    w = workload_from(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that `finally` ends the servers
    common.setup_threads(args.threads)
    python = find_vllm_python(args.vllm_python)
    print(common.machine_facts())
    print(f"workload: {w.groups} groups x {w.group_size} episodes x {w.turns} turns, replies "
          f"{w.reply_tokens} tokens; {args.dtype}; ours {args.threads} threads, vLLM cores "
          f"{args.cores}", flush=True)
    for name in args.models:
        with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
            with LocalService(model_config(name), seed=0) as writer:
                model_dir = str(writer.save_hf_dir(Path(tmp) / name))
            ours = LocalService(model_dir, dtype=args.dtype, cache_bytes=args.kv_gib * 2**30)
            unpacked = (LocalService(model_dir, dtype=args.dtype, pack_weights=False,
                                     cache_bytes=args.kv_gib * 2**30) if args.unpacked else None)
            port = free_port()
            serve = ServerProcess(
                [sys.executable, "-m", "prefixgym", "serve", "--model", model_dir, "--port",
                 str(port), "--max-n", "64", "--kv-cache-gib", str(args.kv_gib), "--dtype",
                 args.dtype], f"http://127.0.0.1:{port}",
                {"OMP_NUM_THREADS": str(args.threads)}, log_path=Path(tmp) / "serve.log",
                name="prefixgym serve")
            launch = VLLMLaunch(model_dir, served_model_name=name, port=free_port(),
                                dtype=args.dtype, block_size=32, kv_cache_gib=args.kv_gib)
            vllm = ServerProcess(launch.argv(python), f"http://127.0.0.1:{launch.port}",
                                 {**launch.env(), "VLLM_CPU_OMP_THREADS_BIND": args.cores},
                                 log_path=Path(tmp) / "vllm.log", name="vLLM")
            try:
                serve.wait_ready(progress=False)
                vllm.wait_ready(progress=False)
                peers = ["ours", *(["ours/unpacked"] if unpacked else []), "ours/http"]
                walls: dict[str, list[float]] = {peer: [] for peer in [*peers, "vllm"]}
                for rep in range(args.repeats):
                    runs: dict[str, RunResult] = {}
                    sampler = ours.create_sampling_client(stop_at_end_of_turn=False)
                    runs["ours"] = drive(sampler, ours.tokenizer, w)
                    if unpacked is not None:
                        runs["ours/unpacked"] = drive(
                            unpacked.create_sampling_client(stop_at_end_of_turn=False),
                            unpacked.tokenizer, w)
                    runs["ours/http"] = over_http(serve.url, model_dir, ours.tokenizer, w)
                    before = vllm_counters(vllm.url)
                    runs["vllm"] = over_http(vllm.url, name, ours.tokenizer, w)
                    after = vllm_counters(vllm.url)
                    server_prompt = after["prompt_tokens"] - before["prompt_tokens"]
                    server_cached = after["prompt_tokens_cached"] - before["prompt_tokens_cached"]
                    for peer, run in runs.items():
                        walls[peer].append(run.wall_s)
                        computed = run.prefill_computed
                        extra = ""
                        if peer == "vllm":
                            computed = int(server_prompt - server_cached)
                            extra = (f" (its answers say {run.prefill_computed}; its counters: "
                                     f"{server_prompt:.0f} prompt tokens over its n-fold "
                                     f"requests, {server_cached:.0f} cached)")
                        minimum = theoretical_min_prefill(run.prompts, run.decoded)
                        print(f"[{name}] rep {rep} {peer}: {run.wall_s:.2f} s, prompt tokens "
                              f"{run.prefill_computed + run.prefill_cached}, computed "
                              f"{computed} = {computed / minimum:.2f}x the minimum {minimum}, "
                              f"sampled {run.sampled}{extra}", flush=True)
                line = f"[{name}] wall: " + "; ".join(
                    f"{peer} {common.spread(v)} s" for peer, v in walls.items())
                base = min(walls["vllm"])
                line += "; vLLM / ours " + ", ".join(
                    f"{peer} {base / min(walls[peer]):.2f}x" for peer in peers)
                print(line, flush=True)
            except Exception:
                for server in (vllm, serve):  # the servers' logs go with the temp dir
                    print(f"--- {server.name}{server.log_tail(40)}", file=sys.stderr)
                raise
            finally:
                vllm.stop()
                serve.stop()
                ours.close()
                if unpacked is not None:
                    unpacked.close()


if __name__ == "__main__":
    main()
