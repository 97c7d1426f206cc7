"""`prefixgym train --fsdp` under torchrun: two gloo ranks train with sharded weights,
rank 0 alone writes the log and a checkpoint in the one-process format (the other rank
helps it gather the optimizer's state), and one process resumes that checkpoint.
(The sharded client's numbers against one process: tests/engine/trainer/test_fsdp.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from prefixgym.cli import main as cli_main
from prefixgym.engine.model import load_model
from prefixgym.engine.trainer.training import TrainingClient
from prefixgym.envs.base import AgentEnv, Outcome

TRAIN = ["--sft-steps", "0", "--groups-per-step", "2", "--group-size", "2",
         "--max-tokens", "4", "--eval-episodes", "2", "--checkpoint-every", "1",
         "--compute-dtype", "float32", "--num-threads", "1", "--no-progress", "--lr", "0.05",
         "--device", "cpu"]  # (gloo)
ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}


class Varied(AgentEnv):
    """One turn; the reward depends on the reply's length, so a group's replies differ
    and GRPO has something to learn from."""

    system_prompt = "Reply with anything."

    def __init__(self) -> None:
        super().__init__(max_turns=1)

    def _reset_task(self) -> str:
        return f"Say {int(self.np_random.integers(100))}."

    def _act(self, text: str) -> Outcome:
        return Outcome("", rewards={"length": (len(text) % 5) / 4}, done=True)


def grpo_steps(out: Path) -> list[int]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in lines if r["phase"] == "grpo"]


def test_a_sharded_run_on_two_ranks_resumes_in_one_process(tmp_path: Path) -> None:
    out = tmp_path / "run"
    flags = ["--out", str(out), "--env", f"{__file__}:Varied", *TRAIN]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--standalone", "-m", "prefixgym", "train", "--fsdp", "--steps", "1", *flags]
    proc = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True,
                          timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert grpo_steps(out) == [0]  # rank 0 alone logs
    # the checkpoint is the one-process format, its weights trained
    client = TrainingClient(load_model("tiny", seed=5))
    assert client.load_state(out / "checkpoints" / "step-000000" / "train").result() == 1
    init = load_model("tiny", seed=0).state_dict()
    assert any(not torch.equal(v, init[k]) for k, v in client.model.state_dict().items())
    client.close()

    assert cli_main(["train", "--resume", "--steps", "2", "--no-fsdp", *flags]) == 0
    assert grpo_steps(out) == [0, 1]
