"""verifiers' `vf-eval` answered by `prefixgym serve`: its chat program (prefixgym's
in-process harness, `prefixgym_verifiers`) runs as a subprocess against the server,
over the test taskset `tests/envs/vf_sums.py`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1")

TASKSETS = Path(__file__).resolve().parents[1] / "envs"


def test_vf_eval_runs_a_taskset_against_prefixgym_serve(server, tmp_path: Path) -> None:
    vf_eval = shutil.which("vf-eval", path=str(Path(sys.executable).parent))
    assert vf_eval is not None, "vf-eval comes with the verifiers extra"
    env = {**os.environ, "PYTHONPATH": str(TASKSETS), "PREFIXGYM_TEST_KEY": "unused"}
    before = server.service.usage()
    proc = subprocess.run(
        [vf_eval, "vf_sums", "--env.agent.harness.id", "prefixgym_verifiers",
         "--env.agent.runtime.type", "subprocess", "-m", "tiny",
         "--client.base-url", f"{server.url}/v1", "--client.api-key-var", "PREFIXGYM_TEST_KEY",
         "--sampling.max-tokens", "4", "-n", "3", "-r", "1", "--no-push"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [traces] = tmp_path.glob("outputs/*/traces.jsonl")
    episodes = [json.loads(line) for line in traces.read_text().splitlines()]
    assert len(episodes) == 3 and all(e["ok"] and not e["errors"] for e in episodes)
    # each scored by the taskset, each reply one this server sampled
    traces = [e["traces"][0] for e in episodes]
    assert all(set(t["rewards"]) == {"correct"} for t in traces)
    assert all(any(n["sampled"] and n["message"]["role"] == "assistant" for n in t["nodes"])
               for t in traces)
    served = server.service.usage() - before
    assert served.sampled_tokens >= 3 and served.prefill_tokens > 0
