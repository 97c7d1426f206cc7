"""Two `prefixgym serve` processes, `prefixgym train` on two gloo ranks under torchrun:
every update pushed to both servers, samples only from the current version, one server
killed in the middle of a step and the run completes; the ranks' result equals one
process accumulating the same shards; rank 0 alone writes; `--resume` goes on.

Run as a script under torchrun (`... test_scale_out.py OUT KILL_PID ARGS...`) this file
is the per-rank worker: `prefixgym train`'s own `main`, with the training calls recorded
and, on rank 0, server KILL_PID killed once the second step's first answer is in.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("uvicorn")

from prefixgym.engine.model import load_model  # noqa: E402
from prefixgym.engine.prefix_trie import shard_by_prefix  # noqa: E402
from prefixgym.engine.training import TrainingClient  # noqa: E402
from prefixgym.envs.base import AgentEnv, Outcome  # noqa: E402
from prefixgym.types import AdamParams, Datum  # noqa: E402

TRAIN = ["--env", f"{__file__}:Varied", "--sft-steps", "0", "--groups-per-step", "4", "--group-size", "2", "--max-tokens", "4",
         "--eval-episodes", "2", "--eval-every", "2", "--checkpoint-every", "1",
         "--compute-dtype", "float32", "--num-threads", "1", "--no-progress", "--lr", "0.01",
         "--lr-schedule", "constant"]
ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}


class Varied(AgentEnv):
    """Two turns; the reward depends on the reply's length, so random replies differ."""

    system_prompt = "Reply with anything."

    def __init__(self, max_turns: int = 2) -> None:
        super().__init__(max_turns=max_turns)

    def _reset_task(self) -> str:
        return f"Say {int(self.np_random.integers(100))}."

    def _act(self, text: str) -> Outcome:
        reward = (len(text) % 5) / 4
        return Outcome("Again.", rewards={"len": reward}, done=self.turn >= 2,
                       success=reward > 0.5)

    def expert_action(self) -> str:
        return "abcd"


def worker(out: Path, kill_pid: int, argv: list[str]) -> None:
    import prefixgym.cli.train as train_cli
    import prefixgym.trainer.run as run_module
    from prefixgym.serving.pool import SamplerPool

    rank = int(os.environ["RANK"])
    calls: list[dict] = []
    kept: dict = {"step": -1, "killed": False}

    def build_run(config, service=None):
        run, service = original_build(config, service)
        kept["service"] = service
        training = run.training
        forward_backward, optim_step = training.forward_backward, training.optim_step

        def recorded_forward_backward(datums, loss_fn, loss_fn_config=None):
            calls.append({"datums": [d.model_dump() for d in datums], "loss_fn": loss_fn})
            return forward_backward(datums, loss_fn, loss_fn_config)

        def recorded_optim_step(adam):
            calls[-1]["adam"] = adam.model_dump()
            return optim_step(adam)

        training.forward_backward = recorded_forward_backward
        training.optim_step = recorded_optim_step
        return run, service

    def collect(sampler, *args, **kwargs):
        kept["step"] = args[3]  # collect(sampler, tokenizer, envs, config, step, ...)
        return original_collect(sampler, *args, **kwargs)

    def send(self, ids, n, request):
        response = original_send(self, ids, n, request)
        if rank == 0 and kept["step"] == 1 and not kept["killed"]:
            kept["killed"] = True  # mid-step: this step's first answer is in, the rest not
            os.kill(kill_pid, signal.SIGKILL)
        return response

    original_build, original_collect = train_cli.build_run, run_module.collect
    original_send = SamplerPool._send
    train_cli.build_run, run_module.collect = build_run, collect
    SamplerPool._send = send  # type: ignore[method-assign]
    assert train_cli.main(argv) == 0
    service = kept["service"]
    torch.save({k: v.clone() for k, v in service.train_model.state_dict().items()},
               out / f"weights_rank{rank}.pt")
    if rank == 0:
        (out / "calls.json").write_text(json.dumps(calls))
        (out / "killed").write_text(str(kept["killed"]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--standalone", *args]
    return subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True,
                          timeout=400, check=False)


def replay(calls: list[dict]) -> dict[str, torch.Tensor]:
    """One process, the same datums: each rank's shard in turn, then the same update."""
    model = load_model("tiny", seed=0)
    single = TrainingClient(model)
    for call in calls:
        datums = [Datum.model_validate(d) for d in call["datums"]]
        for shard in shard_by_prefix([d.model_input.tokens for d in datums], 2):
            if shard:
                single.forward_backward([datums[i] for i in shard], call["loss_fn"]).result()
        single.optim_step(AdamParams(**call["adam"])).result()
    single.close()
    return model.state_dict()


def test_two_servers_two_ranks_one_server_killed_mid_step(tmp_path: Path, wait_healthy) -> None:
    out = tmp_path / "run"
    out.mkdir()
    servers, urls = [], []
    for _ in range(2):
        port = free_port()
        servers.append(subprocess.Popen(
            [sys.executable, "-m", "prefixgym", "serve", "--model", "tiny", "--seed", "5",
             "--port", str(port), "--max-n", "8"],
            env={**os.environ, **ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for url in urls:
            wait_healthy(url, attempts=1200)
        flags = ["--out", str(out), *TRAIN, "--sampler-url", urls[0], "--sampler-url", urls[1]]
        first = torchrun(__file__, str(out), str(servers[1].pid), "--steps", "2", *flags)
        assert first.returncode == 0, first.stderr[-4000:]
        assert servers[1].wait(timeout=30) == -signal.SIGKILL
        assert (out / "killed").read_text() == "True"
        assert first.stdout.count("report:") == 1  # rank 0 alone reports

        lines = [json.loads(line) for line in (out / "metrics.jsonl").open()]
        grpo = [r for r in lines if r["phase"] == "grpo"]
        assert [r["step"] for r in grpo] == [0, 1]  # logged once, not once per rank
        assert [r["step"] for r in lines if r["phase"] == "eval"] == [0, 2]
        assert all(r["sampler/version_lag"] == 0 and r["episodes/off_policy"] == 0
                   for r in grpo)
        assert (grpo[0]["sampler/failed"], grpo[0]["sampler/0/requests"] > 0,
                grpo[0]["sampler/1/requests"] > 0) == (0, True, True)
        assert (grpo[1]["sampler/failed"], grpo[1]["sampler/1/up"]) == (1, 0)
        assert grpo[1]["sampler/retries"] >= 1  # the killed server's requests went elsewhere
        assert (out / "report.md").is_file()
        assert (out / "checkpoints" / "latest").read_text().strip() == "step-000001"

        # both ranks hold what one process accumulating the same shards computes
        calls = json.loads((out / "calls.json").read_text())
        assert len(calls) == 2 and all(call["datums"] for call in calls)
        reference = replay(calls)
        for rank in (0, 1):
            weights = torch.load(out / f"weights_rank{rank}.pt")
            for name, value in reference.items():
                torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-5, msg=name)

        # the live server samples from the trainer's last weights
        label = httpx.get(f"{urls[0]}/get_weight_version").json()["weight_version"]
        prompt = [7, 8, 9, 10, 11, 12]
        echo = httpx.post(f"{urls[0]}/v1/completions", json={
            "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
        assert echo["metadata"]["weight_version"] == label and label.endswith("-4")  # cli, run start, 2 steps
        with torch.no_grad():
            model = load_model("tiny", seed=0)
            model.load_state_dict(reference)
            logits = model(torch.tensor([prompt]))[0].log_softmax(-1)
        want = [float(logits[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
        assert echo["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(want,
                                                                                     abs=1e-4)

        # `-m prefixgym train` itself resumes, on the server left
        resumed = torchrun("-m", "prefixgym", "train", "--out", str(out), "--resume",
                           "--steps", "3", "--sampler-url", urls[0])
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        assert resumed.stderr.count("resuming from") == 1
        lines = [json.loads(line) for line in (out / "metrics.jsonl").open()]
        assert [r["step"] for r in lines if r["phase"] == "grpo"] == [0, 1, 2]
        assert (out / "checkpoints" / "latest").read_text().strip() == "step-000002"
    finally:
        for proc in servers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=30)


if __name__ == "__main__":
    worker(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
