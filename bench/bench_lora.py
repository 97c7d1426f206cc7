"""LoRA vs full training on Qwen2-0.5B's shapes: peak memory, step time, publish time.

1) Build a randomly initialised `Qwen2ForCausalLM` with Qwen2-0.5B's config (896 wide,
   24 layers, 14/2 heads, 4864 MLP, 151,936 vocab, tied embeddings; 494M parameters)
   with transformers and save it to `--dir` (skipped when the directory has one).
2) For each mode (`lora` r=`--rank` on attention and MLP, `full`), in a fresh
   subprocess so that one's memory never counts for the other: load the directory
   into an `EngineService` (fp32), create the training client, then reset the
   process's peak RSS (`/proc/self/clear_refs`) and run `--steps` times one
   forward_backward of `--batch` x `--seq` random tokens (cross_entropy) + optim_step.
   LoRA runs through `EngineService` (version 0 shares the loaded weights); full
   training through a bare `TrainingClient` on `load_model(dir)` (a service would
   add version 0's copy of the weights: 2 GB more). Reported: RSS after loading, peak
   RSS over the steps (the goal's figure: LoRA peak <= 1/3 of full), each step's
   seconds, and the publish time: for LoRA `save_weights_and_get_sampling_client`
   (copies the adapters only), for full training `clone_for_inference()`, which is
   what its publish does (copies every weight), timed before the steps. Goal: <= 5%
   of a GRPO step, here compared to the train step alone, which is a lower bound of
   a GRPO step. LoRA mode also times greedy
   decoding (`--decode-rows` rows x `--decode-tokens` tokens) with the base version
   and with the adapter version: the cost of running the adapters unmerged.

`--max-tokens-per-forward` caps the positions one forward runs (the training
client's chunking; default 512 = one datum per forward): 8 x 512 in one forward
would hold ~2.5 GB of fp32 logits alone. Run by hand, alone on the machine:

    .venv/bin/python bench/bench_lora.py --dir /tmp/qwen2-0.5b-random
    .venv/bin/python bench/bench_lora.py --dir /tmp/q --modes lora   # LoRA only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import common  # sets OMP_WAIT_POLICY=PASSIVE before torch starts its threads
import torch

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                 max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True, use_sliding_window=False)


def make_checkpoint(directory: Path) -> None:
    """Step 1: a random Qwen2-0.5B-shaped checkpoint, saved as safetensors."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN2_05B))
    model.save_pretrained(directory, safe_serialization=True)


def rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(args: argparse.Namespace) -> dict[str, object]:
    """Step 2, in this (fresh) process: one mode's figures."""
    import prefixgym as pg
    from prefixgym.engine.model import load_model
    from prefixgym.engine.service import EngineService
    from prefixgym.engine.trainer.options import TrainerOptions
    from prefixgym.engine.trainer.training import TrainingClient

    common.setup_threads(args.threads)
    # the same memory options in both modes
    options = TrainerOptions(max_tokens_per_forward=args.max_tokens_per_forward,
                             chunked_head=args.chunked_head,
                             recompute_activations=args.recompute_activations)
    t0 = time.perf_counter()
    publish_s: list[float] = []
    if args.mode == "lora":
        svc = EngineService(str(args.dir), thread_tuning=False, max_running=args.decode_rows)
        model = svc.train_model
        client = svc.create_lora_training_client(rank=args.rank, alpha=2.0 * args.rank,
                                                 options=options)
    else:  # the trainer alone: a service would also hold version 0's copy of the weights
        model = load_model(str(args.dir))
        client = TrainingClient(model, options)
        for _ in range(2):  # what publish_weights does, timed before Adam's state exists
            t = time.perf_counter()
            snapshot = model.clone_for_inference()
            publish_s.append(time.perf_counter() - t)
            del snapshot
    load_s = time.perf_counter() - t0
    trainable = sum(p.numel() for p in client._params)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    datums = []
    for _ in range(args.batch):
        toks = torch.randint(0, vocab, (args.seq + 1,), generator=gen).tolist()
        datums.append(pg.Datum(model_input=pg.ModelInput.from_ints(toks[:-1]),
                               loss_fn_inputs={"target_tokens": toks[1:]}))
    rss_loaded = rss_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    step_s = []
    for _ in range(args.steps):
        t = time.perf_counter()
        client.forward_backward(datums, "cross_entropy").result()
        client.optim_step(pg.AdamParams(learning_rate=1e-4)).result()
        step_s.append(time.perf_counter() - t)
    peak = rss_mib("VmHWM")
    if args.mode == "lora":
        for _ in range(3):
            t = time.perf_counter()
            sampler = client.save_weights_and_get_sampling_client()
            publish_s.append(time.perf_counter() - t)
    out: dict[str, object] = {
        "mode": args.mode, "chunked_head": args.chunked_head,
        "recompute_activations": args.recompute_activations, "trainable_params": trainable, "load_s": round(load_s, 1),
        "rss_loaded_mib": round(rss_loaded), "peak_rss_mib": round(peak),
        "step_s": [round(s, 2) for s in step_s], "publish_s": [round(s, 4) for s in publish_s],
    }
    if args.mode == "lora" and args.decode_tokens:
        params = pg.SamplingParams(max_tokens=args.decode_tokens, temperature=0.0)
        prompt = torch.randint(0, vocab, (32,), generator=gen).tolist()
        base = svc.create_sampling_client(stop_at_end_of_turn=False)
        times: dict[str, list[float]] = {"base": [], "lora": []}
        for _ in range(2):  # interleaved; the prefix cache serves the prompt after round 1
            for name, s in (("base", base), ("lora", sampler)):
                t = time.perf_counter()
                s.sample(prompt, num_samples=args.decode_rows, sampling_params=params).result()
                times[name].append(time.perf_counter() - t)
        out["decode_s"] = {k: [round(x, 2) for x in v] for k, v in times.items()}
    client.close()
    if args.mode == "lora":
        svc.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/qwen2-0.5b-random"))
    parser.add_argument("--modes", default="lora,full")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--max-tokens-per-forward", type=int, default=512)
    parser.add_argument("--chunked-head", action=argparse.BooleanOptionalAction, default=True,
                        help="target logprobs a chunk of positions at a time (both modes)")
    parser.add_argument("--recompute-activations", action="store_true",
                        help="checkpoint every block (both modes)")
    parser.add_argument("--decode-rows", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # internal: measure one mode
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(measure(args)), flush=True)
        return
    if not (args.dir / "config.json").is_file():
        t = time.perf_counter()
        code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"import bench_lora, pathlib; "
                f"bench_lora.make_checkpoint(pathlib.Path({str(args.dir)!r}))")
        subprocess.run([sys.executable, "-c", code], check=True)  # its memory freed after
        print(f"built {args.dir} in {time.perf_counter() - t:.0f} s")
    print(common.machine_facts())
    results = {}
    for mode in args.modes.split(","):
        argv = [sys.executable, __file__, "--mode", mode, *sys.argv[1:]]
        proc = subprocess.run(argv, capture_output=True, text=True, env=os.environ)
        if proc.returncode != 0:
            print(f"{mode}: failed (exit {proc.returncode}): {proc.stderr.strip()[-600:]}")
            continue
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(json.dumps(results[mode]))
    if "lora" in results and "full" in results:
        lora, full = results["lora"], results["full"]
        print(f"peak RSS lora/full = {lora['peak_rss_mib'] / full['peak_rss_mib']:.3f} "
              f"(goal <= 0.333); last step lora/full = "
              f"{lora['step_s'][-1] / full['step_s'][-1]:.2f}")
    for mode, r in results.items():
        print(f"{mode}: publish / train step = {min(r['publish_s']) / r['step_s'][-1]:.4f} "
              "(goal <= 0.05 of a GRPO step)")


if __name__ == "__main__":
    main()
