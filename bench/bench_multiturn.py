"""Multi-turn GRPO-style rollouts: the prefix-cached engine vs no cache vs HF `generate`.

Workload (synthetic, as a GRPO rollout would send it): `groups` groups of `group_size`
episodes, `turns` turns each. Every episode is a `Conversation` with one fixed system
prompt; a group's first turn is one request with `num_samples=group_size`; on later
turns every episode sends its own request: the previous prompt + the sampled reply +
a short user message (10-30 tokens) + the assistant header. Replies are exactly
`reply_tokens` long (no stop), so every peer runs the same shapes. Requests of one
turn are submitted together, then awaited.

Peers, on the same weights in the same run, interleaved `--repeats` times:
1) prefixgym with the prefix cache, 2) prefixgym with `prefix_cache=False`,
3) transformers `LlamaForCausalLM.generate`, one left-padded batch per turn,
re-prefilling every prompt.

It reports prefill tokens computed / the theoretical minimum (every distinct prompt
position computed once; positions whose KV a decode step already produced are free),
and wall times with ratios. `--dtype bfloat16` runs both engine peers in bf16 and HF
in every `--hf-dtypes` (default float32 and bfloat16) on the same bf16-rounded weights.
Run by hand:

    .venv/bin/python bench/bench_multiturn.py --presets tiny           # full spec
    .venv/bin/python bench/bench_multiturn.py --quick --presets tiny small
    .venv/bin/python bench/bench_multiturn.py --presets tiny --dtype bfloat16
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import common
import torch

from prefixgym.local_service import LocalService
from prefixgym.prompting import Conversation
from prefixgym.types import SamplingParams

SYSTEM = (
    "You are a careful agent in a text environment. Each turn you read an observation, "
    "think briefly, and reply with one action. Valid actions are look, move north, move "
    "south, move east, move west, take ITEM, use ITEM and answer VALUE. Keep replies short. "
    "Never repeat an action that failed twice. When you know the answer, reply answer VALUE."
)
WORDS = ["red", "blue", "green", "door", "key", "lamp", "north", "south", "east", "west", "box", "gold", "coin", "wall", "path", "river"]


@dataclass
class Workload:
    groups: int
    group_size: int
    turns: int
    reply_tokens: int

    def user_message(self, group: int, episode: int, turn: int) -> str:
        rng = random.Random(f"{group}/{episode}/{turn}")
        return f"Observation {turn}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14)))


@dataclass
class RunResult:
    wall_s: float
    prompts: list[list[int]]  # one per request, in submission order
    decoded: list[tuple[int, list[int]]]  # (prompt length, prompt + sample[:-1]) per sample
    prefill_computed: int
    prefill_cached: int
    sampled: int


def new_conversations(svc_tokenizer, w: Workload) -> list[list[Conversation]]:
    convs = []
    for g in range(w.groups):
        group = []
        for e in range(w.group_size):
            conv = Conversation(svc_tokenizer, system=SYSTEM)
            conv.add_user(w.user_message(g, 0, 0))  # the group's shared first message
            group.append(conv)
        convs.append(group)
    return convs


def drive(sampler, tokenizer, w: Workload) -> RunResult:  # type: ignore[no-untyped-def]
    """The workload against any `SamplingClient` (the engine's, or an HTTP server's);
    the counts are the answers' usage."""
    params = SamplingParams(max_tokens=w.reply_tokens, temperature=1.0)
    convs = new_conversations(tokenizer, w)
    prompts: list[list[int]] = []
    decoded: list[tuple[int, list[int]]] = []
    computed = cached = sampled = 0
    start = time.perf_counter()
    for turn in range(w.turns):
        jobs = []
        if turn == 0:  # a group's shared first prompt: one request for its G samples
            for group in convs:
                prompt = group[0].generation_prompt()
                for conv in group[1:]:
                    conv.generation_prompt()
                jobs.append((group, prompt, sampler.sample(prompt, num_samples=w.group_size,
                                                           sampling_params=params)))
        else:
            for group in convs:
                for conv in group:
                    prompt = conv.generation_prompt()
                    jobs.append(([conv], prompt, sampler.sample(prompt, sampling_params=params)))
        for targets, prompt, future in jobs:
            resp = future.result()
            ids = prompt.to_ints()
            prompts.append(ids)
            decoded.extend((len(ids), ids + s.tokens[:-1]) for s in resp.sequences)
            computed += resp.usage.prefill_computed_tokens
            cached += resp.usage.prefill_cached_tokens
            sampled += resp.usage.sampled_tokens
            for conv, seq in zip(targets, resp.sequences):
                conv.add_sampled(seq.tokens, stop_reason=seq.stop_reason)
        if turn + 1 < w.turns:
            for g, group in enumerate(convs):
                for e, conv in enumerate(group):
                    conv.add_user(w.user_message(g, e, turn + 1))
    return RunResult(time.perf_counter() - start, prompts, decoded, computed, cached, sampled)


def run_engine(preset: str, w: Workload, prefix_cache: bool, dtype: str = "float32") -> RunResult:
    svc = LocalService(preset, seed=0, prefix_cache=prefix_cache, dtype=dtype)
    result = drive(svc.create_sampling_client(stop_at_end_of_turn=False), svc.tokenizer, w)
    svc.check_cache_integrity()
    svc.close()
    return result


def run_hf(hf, tokenizer, w: Workload) -> RunResult:
    hf.generation_config.eos_token_id = None
    convs = new_conversations(tokenizer, w)
    prompts: list[list[int]] = []
    computed = sampled = 0
    torch.manual_seed(0)
    start = time.perf_counter()
    for turn in range(w.turns):
        if turn == 0:
            batch = [(group, group[0].generation_prompt().to_ints()) for group in convs]
            repeat = w.group_size
        else:
            batch = [([conv], conv.generation_prompt().to_ints()) for group in convs for conv in group]
            repeat = 1
        width = max(len(p) for _, p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (_, p) in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=w.reply_tokens,
                              num_return_sequences=repeat, pad_token_id=0)
        replies = out[:, width:].tolist()
        for row, (targets, p) in enumerate(batch):
            prompts.append(p)
            computed += len(p)
            for j, conv in enumerate(targets):
                conv.add_sampled(replies[row * repeat + j], stop_reason="length")
                sampled += w.reply_tokens
        if turn + 1 < w.turns:
            for g, group in enumerate(convs):
                for e, conv in enumerate(group):
                    conv.add_user(w.user_message(g, e, turn + 1))
    return RunResult(time.perf_counter() - start, prompts, [], computed, 0, sampled)


def theoretical_min_prefill(
    prompts: list[list[int]], decoded: list[tuple[int, list[int]]]
) -> int:
    """Distinct prompt positions (a trie over all prompts) minus positions whose KV a
    decode step produced; every prompt's last position is always counted."""
    trie: dict[tuple[int, int], int] = {}
    kind: list[int] = [0]  # per node: 1 = in a prompt, 2 = KV known from decoding
    marked = [(2, start, seq) for start, seq in decoded] + [(1, 0, seq) for seq in prompts]
    for flag, first, seq in marked:
        node = 0
        for i, token in enumerate(seq):
            nxt = trie.get((node, token))
            if nxt is None:
                nxt = trie[(node, token)] = len(kind)
                kind.append(0)
            if i >= first:
                kind[nxt] |= flag
            node = nxt
    total = sum(1 for k in kind if k == 1)  # prompt positions no decode step produced
    # a prompt that ends inside decoded KV still computes its last position
    for seq in prompts:
        node = 0
        for token in seq:
            node = trie[(node, token)]
        if kind[node] & 2:
            total += 1
    return total


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved repetitions")
    parser.add_argument("--quick", action="store_true", help="4 groups x 4 turns, 1 repeat")


def workload_from(args: argparse.Namespace) -> Workload:
    """The workload the flags ask for (`--quick` also sets one repeat)."""
    if args.quick:
        args.groups, args.turns, args.repeats = 4, 4, 1
    return Workload(args.groups, args.group_size, args.turns, args.reply_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny"])
    add_workload_flags(parser)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    parser.add_argument("--no-uncached", action="store_true", help="skip the prefix_cache=False peer")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hf-dtypes", nargs="+", choices=["float32", "bfloat16"], default=None,
                        help="HF peers (default: the engine's dtype, plus float32 for bf16)")
    parser.add_argument("--hf-threads", type=int, nargs="+", default=None,
                        help="thread counts HF runs at (default: 1 and --threads); the engine "
                             "picks its own per step, up to --threads")
    args = parser.parse_args()
    hf_threads = args.hf_threads or sorted({1, args.threads})
    hf_dtypes = args.hf_dtypes or sorted({args.dtype, "float32"}, reverse=True)
    w = workload_from(args)
    common.setup_threads(args.threads)
    print(common.machine_facts())
    print(f"workload: {w.groups} groups x {w.group_size} episodes x {w.turns} turns, "
          f"replies {w.reply_tokens} tokens; engine dtype {args.dtype}, HF {hf_dtypes}")
    for preset in args.presets:
        walls: dict[str, list[float]] = {"cached": [], "uncached": []}
        walls.update({f"hf[{name},{t}t]": [] for name in hf_dtypes for t in hf_threads})
        hfs: dict[str, object] = {}
        for rep in range(args.repeats):
            cached = run_engine(preset, w, prefix_cache=True, dtype=args.dtype)
            walls["cached"].append(cached.wall_s)
            if rep == 0:
                minimum = theoretical_min_prefill(cached.prompts, cached.decoded)
                requests = len(cached.prompts)
                excess = (cached.prefill_computed - minimum) / requests
                print(f"[{preset}] requests={requests} prompt tokens="
                      f"{cached.prefill_computed + cached.prefill_cached} "
                      f"computed={cached.prefill_computed} cached={cached.prefill_cached} "
                      f"min={minimum} ratio={cached.prefill_computed / minimum:.3f} "
                      f"excess/request={excess:.1f} tokens")
            if not args.no_uncached:
                walls["uncached"].append(
                    run_engine(preset, w, prefix_cache=False, dtype=args.dtype).wall_s)
            if not args.no_hf:
                if not hfs:
                    svc = LocalService(preset, seed=0, dtype=args.dtype)
                    for name in hf_dtypes:
                        hfs[name] = common.hf_llama_from(svc.train_model).to(getattr(torch, name))
                        print(f"[{preset}] HF[{name}] vs ours[{args.dtype}] max |logit diff| = "
                              f"{common.check_same_logits(svc.train_model, hfs[name]):.2e}")
                    tokenizer = svc.tokenizer
                    svc.close()
                for name, hf in hfs.items():
                    for threads in hf_threads:
                        with common.num_threads(threads):
                            walls[f"hf[{name},{threads}t]"].append(run_hf(hf, tokenizer, w).wall_s)
            print(f"[{preset}] rep {rep}: " + ", ".join(
                f"{k} {v[-1]:.2f}s" for k, v in walls.items() if v), flush=True)
        base = min(walls["cached"])
        line = f"[{preset}] wall: cached {common.spread(walls['cached'])} s"
        for peer in walls:
            if peer != "cached" and walls[peer]:
                line += (f"; {peer} {common.spread(walls[peer])} s "
                         f"= {min(walls[peer]) / base:.2f}x slower (best vs best)")
        print(line)


if __name__ == "__main__":
    main()
