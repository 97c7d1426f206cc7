"""A LoRA GRPO step at a real model's widths: prefixgym vs TRL's `GRPOTrainer` with peft,
same weights, same task, one run.

The model: Qwen3-0.6B's widths (hidden 1024, MLP 3072, 16 query heads and 8 KV heads of
128, its 151,936-token tied vocabulary, RoPE base 1e6) with 4 of its 28 layers,
random-init by transformers and saved; both sides load that directory. The tokenizer
is word-level over the whole vocabulary ("t0" ... "t151935"), so a prompt's text and
its ids map one to one on both sides. The task: one 512-token prompt, a group of 8
samples of 64 tokens (temperature 1; no stop token), reward = the share of a
completion's ids below half the vocabulary (unequal within every group), group-relative
advantages, one LoRA update (rank 16, alpha 32, on q/k/v/o and gate/up/down), fp32.

  prefixgym  `sample(num_samples=8)` (the prompt prefilled once), the datums, one
             `forward_backward("importance_sampling")` (the shared prompt computed once)
             and `optim_step`, then `save_weights_and_get_sampling_client()` (the adapter
             published: the next step samples from it).
  TRL        `GRPOTrainer(peft_config=LoraConfig(...))`: HF `generate` on the prompt
             repeated 8 times, loss "dapo", beta=0, num_iterations=1.

Interleaving as bench_grpo_trl.py: a `TrainerCallback` runs one prefixgym step inside
TRL's loop, before TRL's timer starts on odd steps and after it stops on even ones;
the first step of each side is a warm-up, dropped. TRL is not a prefixgym dependency:
`.venv/bin/pip install trl` first.

    .venv/bin/python bench/bench_grpo_lora_trl.py            # 3 timed steps
    .venv/bin/python bench/bench_grpo_lora_trl.py --steps 1 --layers 2 --new 32   # quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common  # sets OMP_WAIT_POLICY=PASSIVE before torch starts its threads
import torch

import prefixgym as pg
from prefixgym.local_service import LocalService

VOCAB = 151936
QWEN3_06B = {"hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": VOCAB,
             "max_position_embeddings": 4096, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 1,
             "pad_token_id": 2}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def word_tokenizer() -> Any:
    """A fast tokenizer whose every id is one word: "t<id>"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="t0", eos_token="t1",
                                   pad_token="t2", unk_token="t3")


def reward_of_ids(ids: list[int]) -> float:
    return sum(i < VOCAB // 2 for i in ids) / max(len(ids), 1)


def save_model(directory: Path, layers: int) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**QWEN3_06B, num_hidden_layers=layers)).save_pretrained(
        directory, safe_serialization=True)
    word_tokenizer().save_pretrained(directory)


class Ours:
    def __init__(self, directory: Path, a: argparse.Namespace, prompt: list[int]) -> None:
        self.service = LocalService(str(directory), seed=0, num_threads=a.threads)
        self.training = self.service.create_lora_training_client(
            rank=a.rank, alpha=2.0 * a.rank, compute_dtype=torch.float32)
        self.sampler = self.training.save_weights_and_get_sampling_client()
        self.prompt, self.a = prompt, a
        self.wall_s: list[float] = []
        self.gen_s: list[float] = []
        self.computed: list[int] = []

    def step(self, k: int) -> None:
        a, g = self.a, self.a.group
        t0 = time.perf_counter()
        params = pg.SamplingParams(max_tokens=a.new, temperature=1.0, seed=k, stop_token_ids=[])
        response = self.sampler.sample(self.prompt, num_samples=g, sampling_params=params).result()
        self.gen_s.append(time.perf_counter() - t0)
        rewards = [reward_of_ids(s.tokens) for s in response.sequences]
        mean, std = statistics.mean(rewards), statistics.pstdev(rewards)
        n = len(self.prompt) - 1
        total = sum(len(s.tokens) for s in response.sequences)
        datums = []
        for seq, r in zip(response.sequences, rewards):
            full = self.prompt + seq.tokens
            advantage = (r - mean) / (std + 1e-4)
            weights = [0.0] * n + [1.0 / total] * len(seq.tokens)
            datums.append(pg.Datum(model_input=pg.ModelInput.from_ints(full[:-1]),
                                   loss_fn_inputs={
                                       "target_tokens": full[1:], "weights": weights,
                                       "logprobs": [0.0] * n + list(seq.logprobs),
                                       "advantages": [advantage] * len(weights)}))
        out = self.training.forward_backward(datums, "importance_sampling").result()
        self.training.optim_step(pg.AdamParams(learning_rate=a.lr)).result()
        self.sampler = self.training.save_weights_and_get_sampling_client()
        self.wall_s.append(time.perf_counter() - t0)
        self.computed.append(out.usage.train_computed_tokens)


def build_trl(directory: Path, a: argparse.Namespace, text: str, steps: int, out: str) -> Any:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory)

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return [reward_of_ids(tokenizer(c, add_special_tokens=False)["input_ids"])
                for c in completions]

    config = GRPOConfig(
        output_dir=out, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=a.group, gradient_accumulation_steps=1,
        num_generations=a.group, max_completion_length=a.new, temperature=1.0, top_p=1.0,
        top_k=0, learning_rate=a.lr, lr_scheduler_type="constant", optim="adamw_torch",
        weight_decay=0.0, max_grad_norm=1.0, num_iterations=1, beta=0.0, loss_type="dapo",
        max_steps=steps, logging_steps=1, report_to=[], save_strategy="no",
        disable_tqdm=True, shuffle_dataset=False, dataloader_num_workers=0, seed=0)
    lora = LoraConfig(r=a.rank, lora_alpha=2 * a.rank, target_modules=TARGETS,
                      lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, peft_config=lora,
                          train_dataset=Dataset.from_list([{"prompt": text}] * steps),
                          processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)
    return trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new", type=int, default=64, help="tokens per sample")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    try:
        import trl
        from transformers import TrainerCallback
        from transformers.utils import logging as hf_logging
    except ImportError:
        sys.exit("bench_grpo_lora_trl.py needs TRL: .venv/bin/pip install trl")
    hf_logging.disable_progress_bar()
    common.setup_threads(a.threads)
    print(common.machine_facts())
    prompt = torch.randint(4, VOCAB, (a.prompt,), generator=torch.Generator().manual_seed(1)
                           ).tolist()
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory() as out:
        directory = Path(d)
        save_model(directory, a.layers)
        text = " ".join(f"t{i}" for i in prompt)
        ours = Ours(directory, a, prompt)
        total = a.steps + 1
        trainer = build_trl(directory, a, text, total, out)
        print(f"trl={trl.__version__}; Qwen3-0.6B widths, {a.layers} layers; prompt {a.prompt} "
              f"tokens x group {a.group} x {a.new} new tokens; LoRA rank {a.rank} on "
              f"{', '.join(TARGETS)}; fp32; {total} steps (first dropped)")
        trl_s: list[float] = []

        class Interleave(TrainerCallback):  # type: ignore[misc]
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if state.global_step % 2 == 1:
                    ours.step(state.global_step)
                self.t = time.perf_counter()

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                trl_s.append(time.perf_counter() - self.t)
                if (state.global_step - 1) % 2 == 0:
                    ours.step(state.global_step - 1)

        trainer.add_callback(Interleave())
        common.setup_threads(a.threads)
        trainer.train()
        trl_len = [h["completions/mean_length"] for h in trainer.state.log_history
                   if "completions/mean_length" in h]
        ours.service.close()
    print("\nstep  ours_s (gen)   trl_s  trl/ours  trl_len  ours_train_positions")
    for k in range(total):
        print(f"{k:>4} {ours.wall_s[k]:7.2f} {ours.gen_s[k]:5.2f} {trl_s[k]:7.2f} "
              f"{trl_s[k] / ours.wall_s[k]:8.2f}x {trl_len[k]:8.1f}  {ours.computed[k]:>8,}"
              + ("  (warm-up)" if k == 0 else ""))
    ratios = [t / o for t, o in zip(trl_s[1:], ours.wall_s[1:])]
    print(f"\nprefixgym step s median {statistics.median(ours.wall_s[1:]):.2f} (generation "
          f"{statistics.median(ours.gen_s[1:]):.2f}); TRL {statistics.median(trl_s[1:]):.2f}; "
          f"TRL / prefixgym median {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-"
          f"{max(ratios):.2f}); load {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
