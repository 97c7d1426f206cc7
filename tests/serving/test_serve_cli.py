"""`prefixgym serve` as a command: a real process on a free loopback port, answering
OpenAI requests and taking the full weights `prefixgym train --sampler-url` pushes
from another process (LoRA adapters across processes: test_scale_out.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from numerics import tiny_logprob_atol

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import prefixgym.trainer.run as run_module  # noqa: E402
from prefixgym.cli.train import build_run  # noqa: E402
from prefixgym.serving.launch import free_port  # noqa: E402
from prefixgym.trainer.config import TrainConfig  # noqa: E402


def test_serve_command_answers_openai_requests_and_takes_pushed_weights(
        wait_healthy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, numerics) -> None:
    monkeypatch.setattr(run_module, "write_plots", lambda out, records: [])  # not checked here
    port = free_port()
    cmd = [sys.executable, "-m", "prefixgym", "serve", "--model", "tiny", "--port", str(port),
           "--served-model-name", "pg-tiny", "--max-n", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, attempts=600)
        client = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["pg-tiny"]
        reply = client.completions.create(model="pg-tiny", prompt=[5, 6, 7], max_tokens=3,
                                          temperature=0.0, logprobs=1)
        assert len(reply.choices[0].model_extra["token_ids"]) == 3
        too_many = httpx.post(f"{url}/v1/completions", json={"prompt": [5], "n": 3})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"

        # a full-weights run in this process (other weights: seed 3) samples on the server
        config = TrainConfig(out=str(tmp_path), env="tests/Lengthy-v0", seed=3, sft_steps=0,
                             steps=1, groups_per_step=2, group_size=2, eval_episodes=1,
                             eval_every=10, checkpoint_every=10, max_tokens=4,
                             compute_dtype=numerics.name, progress=False, sampler_url=[url])
        run, service = build_run(config)
        try:
            run.run()
            # the server says it holds the last of 3 pushes (start, step 0, its update)...
            label = httpx.get(f"{url}/get_weight_version").json()["weight_version"]
            step = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()
                    if json.loads(line)["phase"] == "grpo"]
            assert label.endswith("-3") and step[0]["sampler/version_lag"] == 0
            # ...sampled step 0 on-policy (the trainer's rounding apart: tests/numerics.py)
            assert step[0]["sampler/max_logprob_gap"] < tiny_logprob_atol(numerics, fp32=1e-3)
            # ...and answers from the trainer's weights after the update
            echo = httpx.post(f"{url}/v1/completions", json={
                "prompt": [5, 6, 7, 8], "max_tokens": 0, "echo": True, "logprobs": 1}).json()
            assert echo["metadata"]["weight_version"] == label
            with torch.no_grad():
                logits = service.train_model(torch.tensor([[5, 6, 7, 8]]))[0].log_softmax(-1)
            want = [float(logits[i, i + 6]) for i in range(3)]
            assert echo["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(
                want, abs=1e-4)
        finally:
            service.close()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert proc.returncode == 0, proc.stdout.read().decode()[-2000:]


def test_serve_rejects_bad_flags() -> None:
    from prefixgym.cli.serve import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--port", "70000"])
    assert exit_info.value.code == 2


def test_serve_runs_the_built_in_engine_in_the_dtype_asked(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import prefixgym.local_service as local_service
    from prefixgym.cli.serve import main

    asked: list[str] = []

    def record(**kwargs):  # type: ignore[no-untyped-def]
        asked.append(kwargs["dtype"])
        raise ValueError("recorded")  # (the command's one line; no server started)

    monkeypatch.setattr(local_service, "LocalService", record)
    assert main(["--dtype", "bfloat16"]) == 2 and main([]) == 2
    assert asked == ["bfloat16", "float32"]  # auto: float32, as a trainer's default
    assert "cannot load model 'tiny': recorded" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--engine", "sglang"], "--engine must be prefixgym or vllm"),
    (["--dtype", "int8"], "--dtype must be one of auto, float32, bfloat16, float16"),
    (["--engine", "vllm", "--vllm-python", "/nowhere/python"], "is not a file"),
    (["--engine", "vllm", "--vllm-python", sys.executable, "--lora-rank", "1000"],
     "LoRA ranks up to 512"),
    (["--engine", "vllm", "--vllm-python", sys.executable, "--model", "/nowhere"],
     "cannot load model '/nowhere'"),
    (["--engine", "vllm", "--kv-cache-gib", "0.5"], "whole with --engine vllm"),
])
def test_serve_with_vllm_refuses_bad_input_in_one_line(argv: list[str], message: str,
                                                       capsys: pytest.CaptureFixture) -> None:
    from prefixgym.cli.serve import main

    try:
        code = main(argv)
    except SystemExit as e:  # a flag the config refuses: argparse's usage line
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
