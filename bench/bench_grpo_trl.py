"""GRPO step wall time: prefixgym's loop vs TRL's `GRPOTrainer`, same model and task, one run.

The task is single-turn (TRL's loop is single-turn): the prompt is GuessNumber's
first observation ("Guess a number between 1 and H.", H drawn per prompt) under its
system prompt, rendered by our `Conversation`; the reward of a reply is

    1.0                       if it parses as one integer in [1, H]
    -min(len(text), 200)/200  otherwise (shorter garbage is less bad)

The dense second branch gives every group unequal rewards even for the random-init
`tiny` model, so both loops train on all B x G completions in every step (TRL trains
on equal-reward groups too, prefixgym skips them; the script prints the datum count).

One step, both sides: B prompts x G samples (temperature 1, at most N new tokens,
stop on <|im_end|> or <|endoftext|>), rewards, group-relative advantages, one
forward+backward of a per-token-mean policy-gradient loss over the batch, AdamW,
fp32 throughout.
  prefixgym  one `sample(num_samples=G)` per prompt through the engine (prefix cache
             on), `Rollouts` on a max_turns=1 env, `grpo_step` (loss
             "importance_sampling") and `save_weights_and_get_sampling_client()`.
  TRL        `GRPOTrainer` (HF `generate`, no prefix cache, B*G rows re-prefilled),
             loss "dapo", beta=0, num_iterations=1, on `LlamaForCausalLM` holding a
             copy of the same weights (`common.hf_llama_from`).
Interleaving: a `TrainerCallback` runs one prefixgym step inside TRL's loop, before
TRL's timer starts on odd steps and after it stops on even ones (ABBA...), so load
changes hit both alike. TRL's step = on_step_begin -> on_step_end (generation,
rewards, loss, backward, optimizer); its per-step logging is outside. The first step
of each side is a warm-up and is dropped. Per-process CPU seconds are reported too
(all threads; less disturbed by other processes' load than wall time).

Our training client shares token prefixes (the default; each group's prompt and the
system prompt computed once per update); `--no-share-prefixes` runs the plain path.
Printed for ours: train tokens computed per step and without sharing, and the update
(step - generation - publish). Last, the matmul floor of our step (`step_floor.py`:
its linears alone at its shapes, timed right after each of our steps, outside both
timers): how far each part is from it, and how close to it our step would have to
come for TRL / ours to reach 3x; then its eager bound (the floor plus the step's other
ops, each in its cheapest torch kernel; the update's without attention): where TRL's
step is 3x that bound or more, torch's eager kernels do not stand in the way of 3x;
last, the same with the decode steps' kernels run in sequence from Python
(`decode_floor.py`, part 4), what an eager Python generation of these kernels costs.

TRL is not a prefixgym dependency: `.venv/bin/pip install trl` first. Run by hand:

    .venv/bin/python bench/bench_grpo_trl.py            # B=8, G=8, N=32, 6 timed steps
    .venv/bin/python bench/bench_grpo_trl.py --quick    # B=4, G=4, N=16, 2 timed steps
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import common  # sets OMP_WAIT_POLICY=PASSIVE before torch starts its threads
import torch
from step_floor import grpo_step_floor

from prefixgym.envs.base import AgentEnv, Outcome
from prefixgym.envs.guess_number import GuessNumber
from prefixgym.local_service import LocalService
from prefixgym.prompting import Conversation
from prefixgym.rollouts.rollout import RolloutConfig, Rollouts
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.grpo import grpo_step

_INT_RE = re.compile(r"\s*([+-]?\d{1,12})\s*\.?\s*")
SEED_BASE = 1000


def reward_of(text: str, high: int) -> float:
    match = _INT_RE.fullmatch(text)
    if match and 1 <= int(match.group(1)) <= high:
        return 1.0
    return -min(len(text), 200) / 200


def high_of(seed: int) -> int:
    return 8 + seed * 7919 % 93  # 8..100, fixed by the prompt's seed


@functools.cache
def first_observation(high: int) -> str:
    """GuessNumber's first observation, which depends on `high` only (built once per
    value: building an env per reset was timed as part of our generation)."""
    obs, _ = GuessNumber(high=high).reset(seed=0)
    return str(obs[0]["content"])


class GuessOnce(AgentEnv):
    """GuessNumber's first turn as a one-reply task, rewarded by `reward_of`."""

    system_prompt = GuessNumber.system_prompt

    def __init__(self) -> None:
        super().__init__(max_turns=1, invalid_penalty=0.0)
        self.high = 16

    def _reset_task(self) -> str:
        self.high = high_of(int(self.np_random_seed))
        return first_observation(self.high)

    def _act(self, text: str) -> Outcome:
        r = reward_of(text, self.high)
        return Outcome("", rewards={"reward": r}, done=True, success=r == 1.0)


@dataclass
class Record:
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    gen_s: list[float] = field(default_factory=list)
    publish_s: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    train_computed: list[int] = field(default_factory=list)
    train_unshared: list[int] = field(default_factory=list)
    floor_gen_s: list[float] = field(default_factory=list)  # step_floor.py, after each step
    floor_update_s: list[float] = field(default_factory=list)
    eager_gen_s: list[float] = field(default_factory=list)  # floor + the other ops (eager bound)
    eager_update_s: list[float] = field(default_factory=list)
    sequence_gen_s: list[float] = field(default_factory=list)  # decode kernels in sequence

    @property
    def update_s(self) -> list[float]:
        """Per step: step - generation - publish (our update; TRL records no publish)."""
        return [w - g - u for w, g, u in zip(self.wall_s, self.gen_s, self.publish_s)]


class Ours:
    """prefixgym's GRPO step on the B prompts of step k (seeds SEED_BASE + k*B + i)."""

    def __init__(self, service: LocalService, a: argparse.Namespace) -> None:
        self.config = TrainConfig(
            groups_per_step=a.prompts, group_size=a.group, lr=a.lr, loss="importance_sampling",
            max_tokens=a.max_tokens, temperature=a.temperature, compute_dtype="float32",
        )
        self.training = service.create_training_client(share_prefixes=a.share_prefixes)
        self.training.compute_dtype = torch.float32
        self.sampler = self.training.save_weights_and_get_sampling_client()
        self.tokenizer = service.tokenizer
        self.envs = [GuessOnce() for _ in range(a.prompts * a.group)]
        self.rollout = RolloutConfig(max_tokens=a.max_tokens, temperature=a.temperature,
                                     max_turns=1)
        self.record = Record()
        self.datums: list[float] = []
        self.mean_len: list[float] = []

    def step(self, k: int) -> None:
        b, g = self.config.groups_per_step, self.config.group_size
        w0, c0 = time.perf_counter(), time.process_time()
        rollouts = Rollouts(self.sampler, self.tokenizer, self.rollout)

        async def _all() -> list[Any]:
            return list(await asyncio.gather(*(
                rollouts.run_group(self.envs[i * g:(i + 1) * g], SEED_BASE + k * b + i, f"{k}/{i}")
                for i in range(b)
            )))

        groups = asyncio.run(_all())
        gen = time.perf_counter() - w0
        metrics, usage = grpo_step(self.training, groups, self.config, None)
        self.mean_len.append(usage.sampled_tokens / (b * g))
        t_pub = time.perf_counter()
        self.sampler = self.training.save_weights_and_get_sampling_client()
        self.record.publish_s.append(time.perf_counter() - t_pub)
        self.record.wall_s.append(time.perf_counter() - w0)
        self.record.cpu_s.append(time.process_time() - c0)
        self.record.gen_s.append(gen)
        self.record.load.append(os.getloadavg()[0])
        self.record.train_computed.append(usage.train_computed_tokens)
        self.record.train_unshared.append(usage.train_tokens)
        rows = b * g  # the floor of this step's work, measured now (outside both timers)
        prompt = (usage.prefill_computed_tokens + usage.prefill_cached_tokens) / b
        floor = grpo_step_floor(self.training.model, rows, usage.sampled_tokens - rows,
                                usage.prefill_computed_tokens, usage.train_computed_tokens,
                                counts=sorted({1, torch.get_num_threads()}), repeats=1,
                                keys=round(prompt + self.mean_len[-1] / 2),
                                loss_rows=usage.train_loss_tokens)
        self.record.floor_gen_s.append(floor.generation_s)
        self.record.floor_update_s.append(floor.update_s)
        self.record.eager_gen_s.append(floor.eager_generation_s)
        self.record.eager_update_s.append(floor.eager_update_s)
        self.record.sequence_gen_s.append(floor.sequence_generation_s)
        self.datums.append(metrics["datums/count"])


def prompt_rows(tokenizer: Any, n: int) -> list[dict[str, Any]]:
    """TRL's dataset: the same prompts, as text that re-tokenizes to our exact ids."""
    rows = []
    for seed in range(SEED_BASE, SEED_BASE + n):
        env = GuessOnce()
        obs, _ = env.reset(seed=seed)
        conv = Conversation(tokenizer, system=env.system_prompt)
        conv.add_user(obs[0]["content"])
        ids = conv.generation_prompt().tokens
        text = tokenizer.decode(ids)
        if tokenizer(text=[text])["input_ids"][0] != ids:
            raise RuntimeError(f"prompt of seed {seed} does not round-trip through the tokenizer")
        rows.append({"prompt": text, "high": env.high, "prompt_len": len(ids)})
    return rows


def trl_reward(prompts: list[str], completions: list[str], high: list[int],
               **_: Any) -> list[float]:
    return [reward_of(c, h) for c, h in zip(completions, high)]


def build_trl(hf: Any, tokenizer: Any, rows: list[dict[str, Any]], a: argparse.Namespace,
              steps: int, out: str) -> Any:
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    hf.requires_grad_(True)
    hf.train()
    stop_ids = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    hf.config.eos_token_id = hf.generation_config.eos_token_id = stop_ids  # as our sampler's
    config = GRPOConfig(
        output_dir=out, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=a.prompts * a.group, gradient_accumulation_steps=1,
        num_generations=a.group, max_completion_length=a.max_tokens,
        temperature=a.temperature, top_p=1.0, top_k=0, learning_rate=a.lr,
        lr_scheduler_type="constant", optim="adamw_torch", weight_decay=0.0, max_grad_norm=1.0,
        num_iterations=1, beta=0.0, loss_type="dapo", scale_rewards="group",
        max_steps=steps, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
        shuffle_dataset=False, dataloader_num_workers=0, log_completions=False, seed=0,
    )
    trainer = GRPOTrainer(model=hf, reward_funcs=trl_reward, args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    if sorted(trainer.eos_token_ids) != sorted(stop_ids):
        raise RuntimeError(f"TRL stops on {trainer.eos_token_ids}, ours on {stop_ids}")
    trainer.remove_callback(PrinterCallback)  # its per-step dicts; kept in state.log_history
    return trainer


def timed_generate(hf: Any, sink: list[float]) -> None:
    """Adds the seconds of each HF `generate` call to sink[-1]."""
    inner = hf.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            sink[-1] += time.perf_counter() - t0

    hf.generate = generate


def make_callback(ours: Ours, trl: Record) -> Any:
    from transformers import TrainerCallback

    class Interleave(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            k = state.global_step
            if k % 2 == 1:
                ours.step(k)
            trl.gen_s.append(0.0)
            self.t = (time.perf_counter(), time.process_time())

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            trl.wall_s.append(time.perf_counter() - self.t[0])
            trl.cpu_s.append(time.process_time() - self.t[1])
            trl.load.append(os.getloadavg()[0])
            k = state.global_step - 1
            if k % 2 == 0:
                ours.step(k)

    return Interleave()


def summary(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="B=4, G=4, N=16, 2 timed steps")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (B)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--max-tokens", type=int, default=32, help="max completion tokens (N)")
    p.add_argument("--steps", type=int, default=6, help="timed steps (after one warm-up)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-share-prefixes", dest="share_prefixes", action="store_false",
                   help="train without shared prefixes (the plain path)")
    a = p.parse_args()
    if a.quick:
        a.prompts, a.group, a.max_tokens, a.steps = 4, 4, 16, 2
    try:
        import trl
    except ImportError:
        sys.exit("bench_grpo_trl.py needs TRL, which prefixgym does not depend on: "
                 ".venv/bin/pip install trl")
    import transformers

    common.setup_threads(a.threads)
    service = LocalService(model="tiny", seed=0, num_threads=a.threads)
    hf = common.hf_llama_from(service.train_model)
    print(common.machine_facts())
    print(f"trl={trl.__version__} transformers={transformers.__version__} "
          f"max|logit diff| ours vs HF={common.check_same_logits(service.train_model, hf):.2e}")
    total = a.steps + 1
    rows = prompt_rows(service.tokenizer, a.prompts * total)
    lengths = [r["prompt_len"] for r in rows]
    print(f"B={a.prompts} prompts x G={a.group} samples, max {a.max_tokens} new tokens, "
          f"T={a.temperature}, prompt tokens {min(lengths)}-{max(lengths)}, "
          f"{total} steps (first dropped)")

    ours = Ours(service, a)
    trl_rec = Record()
    with tempfile.TemporaryDirectory() as out:
        trainer = build_trl(hf, service.tokenizer, rows, a, total, out)
        timed_generate(hf, trl_rec.gen_s)
        trainer.add_callback(make_callback(ours, trl_rec))
        common.setup_threads(a.threads)
        trainer.train()
    trl_len = [h["completions/mean_length"] for h in trainer.state.log_history
               if "completions/mean_length" in h]

    o, t = ours.record, trl_rec
    print("\nstep  ours_s  (gen)   trl_s  (gen)  trl/ours  ours_cpu  trl_cpu  load1  datums"
          "  mean_len ours/trl")
    for k in range(total):
        print(f"{k:>4} {o.wall_s[k]:7.3f} {o.gen_s[k]:6.3f} {t.wall_s[k]:7.3f} {t.gen_s[k]:6.3f}"
              f" {t.wall_s[k] / o.wall_s[k]:8.2f}x {o.cpu_s[k]:8.2f} {t.cpu_s[k]:8.2f}"
              f" {t.load[k]:6.2f} {ours.datums[k]:6.0f}  {ours.mean_len[k]:5.1f}/{trl_len[k]:5.1f}"
              + ("  (warm-up)" if k == 0 else ""))
    ow, tw = o.wall_s[1:], t.wall_s[1:]
    ratios = [x / y for x, y in zip(tw, ow)]
    cpu_ratios = [x / y for x, y in zip(t.cpu_s[1:], o.cpu_s[1:])]
    print(f"\nprefixgym step s  median (min-max): {summary(ow)}  generation {summary(o.gen_s[1:])}"
          f"  publish {summary(o.publish_s[1:])}")
    update = o.update_s[1:]
    print(f"prefixgym update s (step - generation - publish): {summary(update)}; train tokens "
          f"computed per step {statistics.median(o.train_computed[1:]):,.0f} (without sharing "
          f"{statistics.median(o.train_unshared[1:]):,.0f}); share_prefixes={a.share_prefixes}")
    print(f"TRL step s        median (min-max): {summary(tw)}  generation {summary(t.gen_s[1:])}")
    print(f"TRL / prefixgym wall, per step: median {statistics.median(ratios):.2f}x "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}); CPU-s: median "
          f"{statistics.median(cpu_ratios):.2f}x")
    print(f"load average at end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print_floor(o, t)


def print_floor(o: Record, trl: Record) -> None:
    """Our step against the time of its matmuls alone (`step_floor.py`), each step's floor
    measured right after it: medians over the timed steps of the per-step ratios."""
    ratio = _ratios(o, trl, o.floor_gen_s, o.floor_update_s)
    print(f"matmul floor of our step (its linears at its shapes, after each step): generation "
          f"{summary(o.floor_gen_s[1:])}, update {summary(o.floor_update_s[1:])} s")
    print(f"ours / floor: generation {ratio['generation']:.2f}x, update {ratio['update']:.2f}x, "
          f"step {ratio['step']:.2f}x; TRL / our floor {ratio['trl']:.2f}x, so TRL / ours = 3x "
          f"needs our step within {ratio['trl'] / 3:.2f}x of its floor")
    eager = _ratios(o, trl, o.eager_gen_s, o.eager_update_s)
    print(f"eager bound of our step (the floor plus the other ops in their cheapest torch "
          f"kernels; the update's without attention): generation {summary(o.eager_gen_s[1:])}, "
          f"update {summary(o.eager_update_s[1:])} s; ours / bound: generation "
          f"{eager['generation']:.2f}x, update {eager['update']:.2f}x, step {eager['step']:.2f}x; "
          f"TRL / our bound {eager['trl']:.2f}x ({'above' if eager['trl'] >= 3 else 'below'} "
          f"3x: torch's eager kernels {'do not rule' if eager['trl'] >= 3 else 'rule'} out 3x)")
    seq = _ratios(o, trl, o.sequence_gen_s, o.eager_update_s)
    print(f"with the decode steps' kernels in sequence from Python (decode_floor.py, part 4; "
          f"not a bound) in place of their eager bound: generation {summary(o.sequence_gen_s[1:])}"
          f" s; ours / it: generation {seq['generation']:.2f}x, step {seq['step']:.2f}x; TRL / "
          f"it {seq['trl']:.2f}x, so 3x needs our step within {seq['trl'] / 3:.2f}x of it")


def _ratios(o: Record, trl: Record, gen_s: list[float], update_s: list[float]) -> dict[str, float]:
    """Medians over the timed steps of our generation, update and step, and TRL's step,
    each over its bound of the same step (`gen_s`, `update_s`, their sum)."""
    step_s = [g + u for g, u in zip(gen_s, update_s)]
    return {name: statistics.median([x / f for x, f in zip(xs[1:], fs[1:])])
            for name, xs, fs in (("generation", o.gen_s, gen_s), ("update", o.update_s, update_s),
                                 ("step", o.wall_s, step_s), ("trl", trl.wall_s, step_s))}


if __name__ == "__main__":
    main()
