"""Prefix-cache hit rate with several sampling servers: one server vs a sticky pool vs a
pool that ignores where an episode's prefix lives.

Workload: `--groups` GuessNumber groups of `--group-size` episodes, up to `--turns`
turns, sampled at temperature 1 with fixed seeds, on fresh in-process `prefixgym serve`
apps (loopback HTTP). Peers, each on fresh servers with empty caches:
1) one server; 2) `--servers` servers, `SamplerPool` (episodes stick to the server
that holds their prefix, new groups to the least loaded); 3) the same servers with
`sticky=False` (every request to the least loaded server).
It prints the hit rate (prefill cached / prefill tokens) over all requests and over
later turns only (turn >= 1, where stickiness matters), per server for the pools, and
the ratios to one server. Hit rates are counts, not timings: they do not depend on the
machine's load, only on which server a request lands on. Run by hand:

    .venv/bin/python bench/bench_sampler_pool.py
    .venv/bin/python bench/bench_sampler_pool.py --groups 16 --servers 4
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import gymnasium as gym
import uvicorn

import prefixgym.envs  # noqa: F401  (registers the env ids)
from prefixgym.local_service import LocalService
from prefixgym.rollouts.rollout import RolloutConfig, Rollouts
from prefixgym.serving.app import create_app
from prefixgym.serving.config import ServeConfig
from prefixgym.serving.openai_client import OpenAISamplingClient
from prefixgym.serving.pool import SamplerPool
from prefixgym.types import Usage


def start(service: LocalService) -> tuple[str, uvicorn.Server]:
    server = uvicorn.Server(uvicorn.Config(create_app(service, service.tokenizer,
                                                      ServeConfig(max_n=64)),
                                           host="127.0.0.1", port=0, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", server


def run(sampler, tokenizer, args) -> tuple[Usage, Usage]:
    """All groups concurrently; usage of all requests and of later turns only."""
    config = RolloutConfig(temperature=1.0, max_tokens=8, max_turns=args.turns)
    runner = Rollouts(sampler, tokenizer, config)

    async def everything():
        return await asyncio.gather(*(
            runner.run_group([gym.make("prefixgym/GuessNumber-v0")
                              for _ in range(args.group_size)], 100 + g, f"g{g}")
            for g in range(args.groups)))

    groups = asyncio.run(everything())
    turns = [turn for g in groups for t in g.trajectories for turn in t.turns]
    return (Usage.total(turn.usage for turn in turns),
            Usage.total(turn.usage for turn in turns if turn.reply_start > turns[0].reply_start))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--servers", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for name, n, sticky in (("one server", 1, True), ("pool, sticky", args.servers, True),
                            ("pool, not sticky", args.servers, False)):
        services = [LocalService(model="tiny", seed=0) for _ in range(n)]
        started = [start(s) for s in services]
        pool = SamplerPool([OpenAISamplingClient(url, model="tiny") for url, _ in started],
                           sticky=sticky)
        total, later = run(pool, services[0].tokenizer, args)
        per_server = pool.metrics()
        pool.close()
        for _, server in started:
            server.should_exit = True
        for s in services:
            s.close()
        rows.append((name, total, later, [per_server[f"sampler/{i}/hit_rate"]
                                          for i in range(n)]))
    base_all, base_later = rows[0][1].cache_hit_rate, rows[0][2].cache_hit_rate
    print(f"{args.groups} groups x {args.group_size} episodes, <= {args.turns} turns, "
          f"{args.servers} servers in the pools")
    print(f"{'peer':<18} {'hit rate':>9} {'vs one':>7} {'turns>=1':>9} {'vs one':>7}  per server")
    for name, total, later, each in rows:
        print(f"{name:<18} {total.cache_hit_rate:>9.3f} {total.cache_hit_rate / base_all:>7.3f} "
              f"{later.cache_hit_rate:>9.3f} {later.cache_hit_rate / base_later:>7.3f}  "
              + " ".join(f"{h:.3f}" for h in each))


if __name__ == "__main__":
    main()
