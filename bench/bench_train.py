"""Train throughput: prefixgym's TrainingClient vs transformers' LlamaForCausalLM.

One step = forward + backward + AdamW over a (batch x seq) block of random tokens,
on the same architecture (a built-in preset translated to a LlamaConfig). Prints
train tokens/s for both and their ratio. Run by hand, never in tests:

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_train.py --presets tiny small
    .venv/bin/python bench/bench_train.py --device cuda --steps 10

prefixgym's step includes its own request validation and padding; the HF step uses
the mean cross-entropy that `labels=` computes (same compute, different scale).
"""

from __future__ import annotations

import argparse
import time

import torch

from prefixgym.engine.model import PRESETS, ModelConfig, load_model
from prefixgym.engine.training import TrainingClient
from prefixgym.types import AdamParams, Datum, ModelInput


def hf_llama(config: ModelConfig, device: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.hidden_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        max_position_embeddings=config.max_seq_len,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        attn_implementation="sdpa",  # type: ignore[call-arg]
    )
    model: torch.nn.Module = LlamaForCausalLM(hf_config)
    return model.to(device)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_ours(preset: str, tokens_B_T: torch.Tensor, steps: int, device: str) -> float:
    model = load_model(preset).to(device)
    model.build_rope_tables(device)
    client = TrainingClient(model)
    rows = tokens_B_T.tolist()
    datums = [
        Datum(model_input=ModelInput.from_ints(r[:-1]), loss_fn_inputs={"target_tokens": r[1:]})
        for r in rows
    ]
    adam = AdamParams(learning_rate=1e-4)

    def step() -> None:
        client.forward_backward(datums, "cross_entropy")
        client.optim_step(adam).result()

    step()  # warm-up, creates the optimizer
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    client.close()
    return sum(len(r) - 1 for r in rows) * steps / (time.perf_counter() - start)


def bench_hf(preset: str, tokens_B_T: torch.Tensor, steps: int, device: str) -> float:
    model = hf_llama(PRESETS[preset], device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    tokens = tokens_B_T.to(device)

    def step() -> None:
        inputs = tokens[:, :-1]
        loss = model(input_ids=inputs, labels=inputs).loss  # HF shifts the labels itself
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return tokens[:, 1:].numel() * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(
        f"device={args.device} threads={torch.get_num_threads()} batch={args.batch} "
        f"seq={args.seq} steps={args.steps}"
    )
    for preset in args.presets:
        vocab = PRESETS[preset].vocab_size
        tokens_B_T = torch.randint(0, vocab, (args.batch, args.seq + 1))
        ours = bench_ours(preset, tokens_B_T, args.steps, args.device)
        hf = bench_hf(preset, tokens_B_T, args.steps, args.device)
        print(
            f"{preset:6s} prefixgym {ours:10.0f} tok/s   transformers {hf:10.0f} tok/s   "
            f"ratio {ours / hf:.2f}"
        )


if __name__ == "__main__":
    main()
