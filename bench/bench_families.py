"""Prefill and decode throughput per model family: prefixgym's engine vs transformers on
the same weights, one run.

For each family (docs/models.md) transformers builds a random-init model of one
mid-size shape (4 layers, hidden 512, 8 heads, 2 KV heads, MLP 1536, vocabulary 8192;
the family's own knobs on top: Llama 3's RoPE scaling, Qwen3's q/k norms, Phi-3's fused
projections, SmolLM3's layer without RoPE, OLMo 2's post-norms, Granite's multipliers,
Mistral's 256-position window, Gemma 2's and 3's and OLMo 3's alternating windows,
Qwen3-MoE's and gpt-oss's 8 experts of width 384, 2 per token, gpt-oss's alternating
128-position windows and attention sinks), saves it, and both sides run it from
that directory, fp32:

  prefill  a GRPO group's prompts: 8 prompts of 512 tokens sharing a 448-token prefix
           (a system prompt and a task), one token sampled after each.
           ours, cache off   `LocalService(prefix_cache=False)`: all 8 x 512 positions
           ours, cache on    the shared prefix cached by an earlier request (the turn
                             before): 8 x 64 positions computed
           HF                one forward of the (8, 512) batch (transformers has no
                             prefix cache: every position)
  decode   8 samples of 64 tokens from one 128-token prompt (temperature 1, no stop).
           ours              `sample(num_samples=8)`: one prefill, 8 rows decoding
           HF                `generate` on the prompt repeated 8 times, KV cache on,
                             min_new_tokens=max_new_tokens=64

  train    (ours only, `--train`) one LoRA (rank 16, attention and MLPs) GRPO step: a
           `forward_backward` of the 8 prefill prompts with 64-token replies under
           "importance_sampling", then `optim_step`, in a fresh process: its seconds and
           the process's peak RSS (weights and all).

  windows  (`--windows`, instead of the above; windowed families) what freeing the
           blocks no window reads saves: 8 samples of 512 tokens after a 128-token prompt (several windows
           long), cache off; the peak of KV blocks held by running sequences (bytes, as
           the pool's `running_blocks` figure says after each step) and decode tok/s,
           ours as shipped vs the same engine with the release turned off
           (`scheduler.release_window = 0`, what every family did before), alternating.

  fallback (`--fallback`, llama3's shape) a family with no code here runs through
           transformers' own modeling code, our KV pool behind its attention
           (`hf_fallback.TransformersCodeModel`): the same Llama checkpoint loaded both
           ways, each in its own `LocalService` (fp32), the prefill (cache off and on)
           and decode workloads above; best of `--repeats`, the two alternating.

Throughput is prompt tokens (prefill) or new tokens (decode) per second of the whole
call; each figure is the best of `--repeats` timed calls after one warm-up, the two
sides alternating, so load hits both alike. Ratios > 1 mean ours is faster.

    .venv/bin/python bench/bench_families.py              # every family, 3 repeats
    .venv/bin/python bench/bench_families.py --families qwen3 phi3 --repeats 5
    .venv/bin/python bench/bench_families.py --families llama3 qwen3_moe --train
    .venv/bin/python bench/bench_families.py --families --fallback
    .venv/bin/python bench/bench_families.py --families mistral gemma2 gemma3 olmo3 gpt_oss --windows
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common  # sets OMP_WAIT_POLICY=PASSIVE before torch starts its threads
import torch
import transformers as tf

import prefixgym as pg
from prefixgym.local_service import LocalService
from prefixgym.prompting.tokenizer import load_tokenizer
from prefixgym.types import SampleRequest

SHAPE: dict[str, Any] = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
                         "num_attention_heads": 8, "num_key_value_heads": 2,
                         "vocab_size": 8192, "max_position_embeddings": 4096,
                         "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                         "tie_word_embeddings": False}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("Llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}}),
    "qwen2": ("Qwen2", {}),
    "qwen3": ("Qwen3", {"head_dim": 64}),
    "phi3": ("Phi3", {}),
    "smollm3": ("SmolLM3", {"no_rope_layers": [1, 1, 1, 0]}),
    "olmo2": ("Olmo2", {}),
    "granite": ("Granite", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                            "attention_multiplier": 0.0156, "logits_scaling": 8.0}),
    "mistral": ("Mistral", {"sliding_window": 256}),
    "olmo3": ("Olmo3", {"sliding_window": 256}),  # layers 1-3 windowed, 4 global
    "gemma2": ("Gemma2", {"sliding_window": 256, "head_dim": 64, "query_pre_attn_scalar": 64}),
    "gemma3": ("Gemma3Text", {"sliding_window": 256, "head_dim": 64, "query_pre_attn_scalar": 64,
                              "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}),
    "qwen3_moe": ("Qwen3Moe", {"head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 384, "norm_topk_prob": True}),
    "gpt_oss": ("GptOss", {"head_dim": 64, "num_local_experts": 8, "num_experts_per_tok": 2,
                           "intermediate_size": 384, "sliding_window": 128,
                           "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0,
                                               "factor": 4.0, "beta_fast": 32.0,
                                               "beta_slow": 1.0, "truncate": False,
                                               "original_max_position_embeddings": 1024}}),
}
MODEL_CLASSES = {"Gemma3Text": "Gemma3ForCausalLM", "Qwen3Moe": "Qwen3MoeForCausalLM"}
GROUP, PROMPT, SHARED = 8, 512, 448
DECODE_PROMPT, NEW = 128, 64


def best(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, SHAPE["vocab_size"], (n,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


def save_family(name: str, directory: Path) -> Any:
    """The family's random-init transformers model, saved in `directory` (tokenizer too)."""
    arch, overrides = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(tf, f"{arch}Config")(**{**SHAPE, **overrides})
    hf = getattr(tf, MODEL_CLASSES.get(arch, f"{arch}ForCausalLM"))(config)
    hf.save_pretrained(directory, safe_serialization=True)
    load_tokenizer().save_pretrained(directory)  # the engine reads the directory's tokenizer
    return hf.eval()


def run_family(name: str, directory: Path, repeats: int, model: Any = None
               ) -> dict[str, float]:
    """The prefill and decode workloads, ours against transformers' `generate`; with
    `model`, that model object in our engine (the checkpoint is in `directory`)."""
    hf = save_family(name, directory) if model is None else tf.AutoModelForCausalLM.from_pretrained(
        directory).eval()
    shared = ids(SHARED, 1)
    prompts = [shared + ids(PROMPT - SHARED, 10 + i) for i in range(GROUP)]
    one = pg.SamplingParams(max_tokens=1, temperature=1.0, seed=0)
    decode_prompt = ids(DECODE_PROMPT, 2)
    new = pg.SamplingParams(max_tokens=NEW, temperature=1.0, seed=0, stop_token_ids=[])
    batch = torch.tensor(prompts)
    out: dict[str, float] = {}
    tails = [ids(PROMPT - SHARED, 10 + i) for i in range(GROUP)]
    engine_model = str(directory) if model is None else model
    with LocalService(engine_model, seed=0, prefix_cache=False, tokenizer=directory) as off, \
            LocalService(engine_model, seed=0, tokenizer=directory) as on:
        s_off = off.create_sampling_client(stop_at_end_of_turn=False)
        s_on = on.create_sampling_client(stop_at_end_of_turn=False)

        def ours_off() -> None:
            for f in s_off.sample_many([SampleRequest(p, 1, one) for p in prompts]):
                f.result()

        def hf_prefill() -> None:
            with torch.no_grad():
                hf(batch).logits[:, -1].float()

        def ours_decode() -> None:
            r = s_off.sample(decode_prompt, num_samples=GROUP, sampling_params=new).result()
            assert all(len(s.tokens) == NEW for s in r.sequences)

        def hf_decode() -> None:
            with torch.no_grad():
                hf.generate(torch.tensor([decode_prompt] * GROUP), do_sample=True,
                            max_new_tokens=NEW, min_new_tokens=NEW, top_k=0, top_p=1.0,
                            pad_token_id=0)

        on_times, computed = [], 0
        for k in range(repeats + 1):  # each time a prefix the turn before cached, untimed
            prefix = ids(SHARED, 100 + k)
            s_on.sample(prefix, sampling_params=one).result()
            before = on.usage().prefill_computed_tokens
            t0 = time.perf_counter()
            for f in s_on.sample_many([SampleRequest(prefix + t, 1, one) for t in tails]):
                f.result()
            on_times.append(time.perf_counter() - t0)
            computed = on.usage().prefill_computed_tokens - before
        out["ours_on"], out["on_computed"] = min(on_times[1:]), computed
        for which, fn in (("ours_off", ours_off), ("hf", hf_prefill),
                          ("ours_decode", ours_decode), ("hf_decode", hf_decode)):
            out[which] = best(fn, repeats)
    return out


def window_release(name: str, directory: Path, repeats: int) -> dict[str, float]:
    """Peak KV bytes held and best decode seconds, release on and off (module docstring)."""
    save_family(name, directory)
    prompt, new = ids(DECODE_PROMPT, 2), 512
    params = pg.SamplingParams(max_tokens=new, temperature=1.0, seed=0, stop_token_ids=[])
    out: dict[str, float] = {}
    with LocalService(str(directory), seed=0, prefix_cache=False) as svc:
        engine = svc.engine
        sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
        window = engine.scheduler.release_window
        out["window"], out["groups"] = window, engine.runner.pool.layout.groups
        step = engine.step

        def run(release: int, probe: bool) -> float:
            engine.scheduler.release_window = release
            peak = [0]

            def probed() -> None:
                step()
                peak[0] = max(peak[0], engine.cache.stats()["running_blocks"])

            engine.step = probed if probe else step  # type: ignore[method-assign]
            t0 = time.perf_counter()
            r = sampler.sample(prompt, num_samples=GROUP, sampling_params=params).result()
            seconds = time.perf_counter() - t0
            engine.step = step  # type: ignore[method-assign]
            assert all(len(s.tokens) == new for s in r.sequences)
            if probe:
                out[f"peak_{bool(release)}"] = peak[0] * engine.cache.block_bytes
            return seconds

        for release in (window, 0):
            run(release, probe=True)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeats):
            for release in (window, 0):
                times[bool(release)].append(run(release, probe=False))
        out["s_True"], out["s_False"] = min(times[True]), min(times[False])
    return out


def train_step(directory: str) -> tuple[float, float]:
    """(seconds of one LoRA GRPO step, peak RSS in GiB of this process): run in a fresh one."""
    import resource

    common.setup_threads(2)
    shared = ids(SHARED, 1)
    datums = []
    for i in range(GROUP):
        tokens = shared + ids(PROMPT - SHARED + 64, 10 + i)
        n = len(tokens) - 1
        weights = [0.0] * (PROMPT - 1) + [1.0] * (n - PROMPT + 1)
        datums.append(pg.Datum(model_input=pg.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": tokens[1:], "weights": weights, "logprobs": [-1.0] * n,
            "advantages": [(i % 3 - 1) * w for w in weights]}))
    with LocalService(directory, seed=0) as svc:
        client = svc.create_lora_training_client(rank=16)
        client.forward_backward(datums[:2], "importance_sampling").result()  # warm-up
        client.optim_step(pg.AdamParams(learning_rate=1e-4)).result()
        t0 = time.perf_counter()
        client.forward_backward(datums, "importance_sampling").result()
        client.optim_step(pg.AdamParams(learning_rate=1e-4)).result()
        seconds = time.perf_counter() - t0
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def fallback(directory: Path, repeats: int) -> dict[str, dict[str, float]]:
    """The llama3 checkpoint run by our decoder and by transformers' code (through
    `hf_fallback`), each through `run_family`'s engine workloads."""
    import dataclasses
    import warnings

    from prefixgym.engine.model import load_model
    from prefixgym.engine.model.hf_config import read_raw_config
    from prefixgym.engine.model.hf_fallback import load_with_transformers

    save_family("llama3", directory)
    ours = load_model(str(directory))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (that it runs through transformers' code)
        theirs = load_with_transformers(directory, dataclasses.replace(
            ours.config, family="transformers"), read_raw_config(directory), torch.float32)
    return {"ours": run_family("llama3", directory, repeats, model=ours),
            "transformers": run_family("llama3", directory, repeats, model=theirs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", nargs="*", default=sorted(FAMILIES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--train", action="store_true", help="also time a LoRA GRPO step")
    p.add_argument("--windows", action="store_true",
                   help="instead of the table, what freeing out-of-window blocks saves "
                   "(the windowed families among --families)")
    p.add_argument("--fallback", action="store_true",
                   help="also time transformers' modeling code over our KV pool (llama3)")
    a = p.parse_args()
    tf.utils.logging.disable_progress_bar()
    common.setup_threads(a.threads)
    print(common.machine_facts())
    print(f"transformers={tf.__version__}; shape {SHAPE['num_hidden_layers']} layers, hidden "
          f"{SHAPE['hidden_size']}, MLP {SHAPE['intermediate_size']}, vocab {SHAPE['vocab_size']}; "
          f"prefill {GROUP} x {PROMPT} tokens sharing {SHARED}; decode {GROUP} x {NEW} new "
          f"tokens after {DECODE_PROMPT}; best of {a.repeats}")
    tokens = GROUP * PROMPT
    steps = []
    if a.families and not a.windows:
        print(f"\n{'family':<9} {'prefill tok/s: ours-off':>23} {'ours-on':>9} {'HF':>9} "
              f"{'off/HF':>7} {'on/HF':>7}   {'decode tok/s: ours':>19} {'HF':>8} {'ours/HF':>8}")
    for name in [] if a.windows else a.families:
        with tempfile.TemporaryDirectory() as d:
            r = run_family(name, Path(d), a.repeats)
            if a.train:
                with multiprocessing.get_context("spawn").Pool(1) as pool:
                    steps.append((name, *pool.apply(train_step, (d,))))
        off, on, hf = tokens / r["ours_off"], tokens / r["ours_on"], tokens / r["hf"]
        dec, hf_dec = GROUP * NEW / r["ours_decode"], GROUP * NEW / r["hf_decode"]
        print(f"{name:<9} {off:23,.0f} {on:9,.0f} {hf:9,.0f} {off / hf:6.2f}x {on / hf:6.2f}x"
              f"   {dec:19,.0f} {hf_dec:8,.0f} {dec / hf_dec:7.2f}x", flush=True)
    if a.windows:
        print(f"\n{'family':<9} {'window':>6} {'groups':>6} {'peak KV MiB: freed':>19} "
              f"{'kept':>7} {'freed/kept':>10}   {'decode tok/s: freed':>20} {'kept':>7} "
              f"{'ratio':>6}   ({GROUP} x 512 after {DECODE_PROMPT})")
        for name in a.families:
            if not any(k in FAMILIES[name][1] for k in ("sliding_window", "layer_types")):
                continue
            with tempfile.TemporaryDirectory() as d:
                w = window_release(name, Path(d), a.repeats)
            freed, kept = w["peak_True"] / 2**20, w["peak_False"] / 2**20
            fast, slow = GROUP * 512 / w["s_True"], GROUP * 512 / w["s_False"]
            print(f"{name:<9} {w['window']:6.0f} {w['groups']:6.0f} {freed:19.1f} {kept:7.1f} "
                  f"{freed / kept:10.2f}   {fast:20,.0f} {slow:7,.0f} {fast / slow:5.2f}x",
                  flush=True)
    if a.fallback:
        with tempfile.TemporaryDirectory() as d:
            f = fallback(Path(d), a.repeats)
        ours, theirs = f["ours"], f["transformers"]
        print(f"\nllama3 in our engine: our decoder vs transformers' modeling code over our KV "
              f"views (hf_fallback); seconds, best of {a.repeats}, and transformers'/ours")
        for key, what in (("ours_off", f"prefill {GROUP} x {PROMPT}, cache off"),
                          ("ours_on", f"prefill {GROUP} x {PROMPT}, cache on"),
                          ("ours_decode", f"decode {GROUP} x {NEW}")):
            print(f"  {what:<28} ours {ours[key]:.3f} s   transformers' code "
                  f"{theirs[key]:.3f} s   {theirs[key] / ours[key]:.2f}x")
    if steps:
        print(f"\n{'family':<9} {'LoRA GRPO step (8 x 576 positions), s':>38} {'peak RSS GiB':>13}")
        for name, seconds, rss in steps:
            print(f"{name:<9} {seconds:38.2f} {rss:13.2f}")


if __name__ == "__main__":
    main()
