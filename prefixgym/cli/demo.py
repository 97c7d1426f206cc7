"""`prefixgym demo`: a short multi-turn sampling session that prints the usage ledger.

Four turns of one conversation, each sampled as a group of four, with the prompt
built by appending the sampled tokens: every turn after the first reads its history
from the prefix cache. Runs the untrained `tiny` model, so the replies are noise;
the token accounting is the point.
"""

from __future__ import annotations

import argparse

from prefixgym.types import SamplingParams


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="prefixgym demo", description=__doc__)
    parser.add_argument("--model", default="tiny", help="preset or local HF checkpoint dir")
    parser.add_argument("--turns", type=int, default=4, help="assistant turns")
    parser.add_argument("--samples", type=int, default=4, help="samples per turn (one prefill)")
    parser.add_argument("--device", default="auto",
                        help="cpu, cuda, cuda:N, mps, or auto (a GPU when torch sees one)")
    args = parser.parse_args(argv)

    from prefixgym.engine.device import describe_device
    from prefixgym.local_service import LocalService
    from prefixgym.prompting import Conversation

    try:
        service = LocalService(model=args.model, seed=0, device=args.device)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    print(f"model: {args.model} on {describe_device(service.device)}")
    sampler = service.create_sampling_client()
    conv = Conversation(tokenizer=service.tokenizer,
                        system="You play a guessing game. Reply with one integer only.")
    conv.add_user("Guess a number between 1 and 16.")
    print(f"{'turn':>4} {'prompt':>7} {'computed':>9} {'cached':>7} {'sampled':>8}  reply")
    for turn in range(args.turns):
        prompt = conv.generation_prompt()
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=turn)
        response = sampler.sample(prompt, num_samples=args.samples,
                                  sampling_params=params).result()
        u = response.usage
        seq = response.sequences[0]
        conv.add_sampled(seq.tokens, stop_reason=seq.stop_reason)
        print(f"{turn:>4} {prompt.length:>7} {u.prefill_computed_tokens:>9} "
              f"{u.prefill_cached_tokens:>7} {u.sampled_tokens:>8}  {conv.last_reply_text!r}")
        conv.add_user("Higher." if turn % 2 else "Lower.")
    total = service.usage()
    print("\nusage ledger (whole session):")
    for name, value in total.model_dump().items():
        print(f"  {name:<24} {value:>7}")
    print(f"  {'cache hit rate':<24} {total.cache_hit_rate:>7.1%}")
    print(f"  extension property held: {conv.extension_ok}")
    service.close()
    return 0
