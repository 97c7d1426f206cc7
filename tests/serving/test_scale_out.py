"""Two `prefixgym serve` processes (or two real vLLM servers), `prefixgym train
--lora-rank` on two gloo ranks
under torchrun: every update is pushed to both servers as a LoRA adapter
(`/v1/load_lora_adapter`), sampled by name, the adapter two versions back unloaded;
one server is killed in the middle of a step and the run completes; the ranks'
adapters equal one process accumulating the same shards; rank 0 alone writes;
`--resume` goes on and clears the first process's adapters from the server.

Run as a script under torchrun (`... test_scale_out.py OUT KILL_PID ARGS...`) this file
is the per-rank worker: `prefixgym train`'s own `main`, with the training calls, every
sampling answer (which adapter was asked for, which weights the server says answered)
and, after every publish, each server's loaded adapters (`GET /v1/models`) recorded;
on rank 0, server KILL_PID is killed once the second step's first answer is in.
(Full weights across processes: tests/serving/test_serve_cli.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("uvicorn")

from prefixgym.engine.model import load_model  # noqa: E402
from prefixgym.engine.service import EngineService  # noqa: E402
from prefixgym.engine.trainer.prefix_trie import shard_by_prefix  # noqa: E402
from prefixgym.envs.base import AgentEnv, Outcome  # noqa: E402
from prefixgym.serving.launch import ServerProcess, free_port  # noqa: E402
from prefixgym.types import AdamParams, Datum  # noqa: E402

LORA_RANK = 4
TRAIN = ["--env", f"{__file__}:Varied", "--sft-steps", "0", "--groups-per-step", "4", "--group-size", "2", "--max-tokens", "4",
         "--eval-episodes", "2", "--eval-every", "2", "--eval-on-start", "--checkpoint-every", "1",
         "--compute-dtype", "float32", "--num-threads", "1", "--no-progress", "--lr", "0.05",
         "--lr-schedule", "constant", "--lora-rank", str(LORA_RANK)]
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


def loaded_models(url: str) -> list[str] | None:
    """What the server at `url` serves (the base and its adapters); None if it is down."""
    try:
        return [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]
    except httpx.HTTPError:
        return None


def worker(out: Path, kill_pid: int, argv: list[str]) -> None:
    import prefixgym.cli.train as train_cli
    import prefixgym.serving.openai_client as openai_client
    import prefixgym.trainer.env_source as env_source
    import prefixgym.trainer.run as run_module
    from prefixgym.cli import main as cli_main
    from prefixgym.serving.pool import SamplerPool
    from prefixgym.serving.weight_sync import RemoteWeightSync

    rank = int(os.environ["RANK"])
    calls: list[dict] = []
    steps: list[dict] = []  # per GRPO step: the adapter its sampler is pinned to
    answers: list[dict] = []  # per sampling answer: what was asked for, what answered
    pushes: list[dict] = []  # per publish (rank 0): each server's models after it
    kept: dict = {"step": -1, "killed": False}
    lock, local = threading.Lock(), threading.local()

    def build_run(config, service=None, **more):
        run, service = original_build(config, service, **more)
        kept["training"] = train_cli.unwrap(run.training)
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
        steps.append({"step": args[3], "pinned": sampler.label})
        return original_collect(sampler, *args, **kwargs)

    def send(self, ids, n, request):
        response = original_send(self, ids, n, request)
        if rank == 0 and kept["step"] == 1 and not kept["killed"]:
            kept["killed"] = True  # mid-step: this step's first answer is in, the rest not
            os.kill(kill_pid, signal.SIGKILL)
        return response

    def weights_version(data, version_from):
        local.said = {"model": data.get("model"), "metadata": data.get("metadata")}
        return original_weights_version(data, version_from)

    def sample_now(self, ids, n, params, with_prompt_logprobs=False, model=None,
                   version_from="metadata"):
        response = original_sample_now(self, ids, n, params, with_prompt_logprobs, model,
                                       version_from)
        with lock:
            answers.append({"server": self.root_url, "asked": model, **local.said})
        return response

    def push(self, path, label, version):
        original_push(self, path, label, version)
        pushes.append({"label": label, "models": [loaded_models(c.root_url)
                                                  for c in self.pool.clients]})

    original_build, original_collect = train_cli.build_run, env_source.collect
    original_send, original_push = SamplerPool._send, RemoteWeightSync._push
    original_weights_version = openai_client._weights_version
    original_sample_now = openai_client.OpenAISamplingClient.sample_now
    train_cli.build_run, env_source.collect = build_run, collect
    openai_client._weights_version = weights_version
    SamplerPool._send = send  # type: ignore[method-assign]
    RemoteWeightSync._push = push  # type: ignore[method-assign]
    openai_client.OpenAISamplingClient.sample_now = sample_now  # type: ignore[method-assign]
    run_module.write_plots = lambda out, records: []  # (the resumed run writes them)
    assert cli_main(["train", *argv]) == 0
    model = kept["training"].model
    torch.save({k: v.clone() for k, v in model.state_dict().items()},
               out / f"weights_rank{rank}.pt")
    record = {"steps": steps, "answers": answers, "pushes": pushes, "killed": kept["killed"]}
    (out / f"record_rank{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        (out / "calls.json").write_text(json.dumps(calls))


def torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--standalone", *args]
    return subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True,
                          timeout=400, check=False)


def replay(calls: list[dict]) -> torch.nn.Module:
    """One process, the same datums: each rank's shard in turn, then the same update;
    the LoRA model trained."""
    with EngineService(load_model("tiny", seed=0)) as service:
        single = service.create_lora_training_client(rank=LORA_RANK, seed=0)
        for call in calls:
            datums = [Datum.model_validate(d) for d in call["datums"]]
            for shard in shard_by_prefix([d.model_input.tokens for d in datums], 2):
                if shard:
                    single.forward_backward([datums[i] for i in shard],
                                            call["loss_fn"]).result()
            single.optim_step(AdamParams(**call["adam"])).result()
        return single.model


def prompt_logprobs(model: torch.nn.Module, prompt: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0].log_softmax(-1)
    return [float(logits[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]


@pytest.mark.parametrize("engine", ["prefixgym", pytest.param(
    "vllm", marks=[pytest.mark.vllm, pytest.mark.xdist_group("vllm")])])
def test_two_servers_two_ranks_lora_one_server_killed_mid_step(
        engine: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    from real_servers import VLLMServer  # (not in the ranks, which load Varied)

    out = tmp_path / "run"
    out.mkdir()
    started: list[ServerProcess] = []  # stopped at the end (the session's vLLM is not)
    if engine == "vllm":  # the session's server and one of this test's own, to kill
        servers = [request.getfixturevalue("vllm").process]
        started.append(VLLMServer(tmp_path).process)
        servers.append(started[-1])
    else:  # the trainer's base weights (seed 0): an adapter is a difference
        for _ in range(2):
            port = free_port()
            started.append(ServerProcess(
                [sys.executable, "-m", "prefixgym", "serve", "--model", "tiny", "--seed", "0",
                 "--port", str(port), "--max-n", "8"], f"http://127.0.0.1:{port}", ENV))
        servers = list(started)
    urls = [server.url for server in servers]
    try:
        for server in servers:
            server.wait_ready(timeout_s=600, progress=False)
        flags = ["--out", str(out), *TRAIN, "--sampler-url", urls[0], "--sampler-url", urls[1]]
        first = torchrun(__file__, str(out), str(servers[1].pid), "--steps", "2", *flags)
        assert first.returncode == 0, first.stderr[-4000:]
        assert servers[1].process.wait(timeout=30) == -signal.SIGKILL
        assert first.stdout.count("report:") == 1  # rank 0 alone reports
        records = [json.loads((out / f"record_rank{r}.json").read_text()) for r in (0, 1)]
        assert records[0]["killed"] is True

        # 1) publishes: the start's (1), before step 0 (2), after steps 0 and 1 (3, 4);
        # each loaded on every live server, the one two back unloaded there
        pushes = records[0]["pushes"]
        token = pushes[0]["label"].removesuffix("-1")
        label = [f"{token}-{v}" for v in range(5)]  # label[v]: version v
        assert [p["label"] for p in pushes] == label[1:]
        assert [p["models"] for p in pushes] == [
            [["tiny", label[1]]] * 2,
            [["tiny", label[1], label[2]]] * 2,
            [["tiny", label[2], label[3]]] * 2,
            [["tiny", label[3], label[4]], None],  # server 1 was killed during step 1
        ]
        assert records[1]["pushes"] == []  # rank 0 alone pushes

        # 2) every answer came from the adapter it asked for, the step's current one
        for record in records:
            assert [s["pinned"] for s in record["steps"]] == [label[2], label[3]]
            for answer in record["answers"]:
                assert answer["asked"] in label[1:]
                assert answer["model"] == answer["asked"]
                assert answer["metadata"] == (  # vLLM's answers say it by `model` alone
                    None if engine == "vllm" else {"weight_version": answer["asked"]})
        grpo0 = [a["server"] for r in records for a in r["answers"] if a["asked"] == label[2]]
        assert set(grpo0) == set(urls)  # step 0 spread over both servers
        rank0_asked = {a["asked"] for a in records[0]["answers"]}
        assert rank0_asked == set(label[1:])  # evaluations: versions 1 and 4
        assert {a["asked"] for a in records[1]["answers"]} == {label[2], label[3]}

        # 3) the metrics: on-policy (the served logprobs are the trainer's), and the
        # killed server's requests retried on the other one, its failure counted
        lines = [json.loads(line) for line in (out / "metrics.jsonl").open()]
        grpo = [r for r in lines if r["phase"] == "grpo"]
        assert [r["step"] for r in grpo] == [0, 1]  # logged once, not once per rank
        assert [r["step"] for r in lines if r["phase"] == "eval"] == [0, 2]
        assert all(r["sampler/version_lag"] == 0 and r["episodes/off_policy"] == 0
                   for r in grpo)
        assert all(r["sampler/max_logprob_gap"] < 1e-3 for r in grpo)
        assert (grpo[0]["sampler/failed"], grpo[0]["sampler/0/requests"] > 0,
                grpo[0]["sampler/1/requests"] > 0) == (0, True, True)
        assert (grpo[1]["sampler/failed"], grpo[1]["sampler/1/up"]) == (1, 0)
        assert grpo[1]["sampler/retries"] >= 1  # the killed server's requests went elsewhere
        assert [r["episodes/failed"] for r in grpo] == [0, 0]  # ...and no episode was lost
        assert (out / "report.md").is_file()
        assert (out / "checkpoints" / "latest").read_text().strip() == "step-000001"

        # 4) both ranks hold what one process accumulating the same shards computes
        calls = json.loads((out / "calls.json").read_text())
        assert len(calls) == 2 and all(call["datums"] for call in calls)
        trained = replay(calls)
        reference = trained.state_dict()
        for rank in (0, 1):
            weights = torch.load(out / f"weights_rank{rank}.pt")
            assert weights.keys() == reference.keys()
            for name, value in reference.items():
                torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-5, msg=name)

        # 5) the live server's newest adapter is the trainer's last weights
        prompt = [7, 8, 9, 10, 11, 12]
        echo = httpx.post(f"{urls[0]}/v1/completions", json={
            "model": label[4], "prompt": prompt, "max_tokens": 0, "echo": True,
            "logprobs": 1}).json()
        assert echo["model"] == label[4]
        served = echo["choices"][0]["logprobs"]["token_logprobs"][1:]
        assert served == pytest.approx(prompt_logprobs(trained, prompt), abs=1e-4)
        base = prompt_logprobs(load_model("tiny", seed=0), prompt)
        assert served != pytest.approx(base, abs=1e-3)  # the adapter changed the answer

        # 6) `-m prefixgym train` itself resumes on the server left, as a LoRA run (the
        # saved config), and unloads the first process's adapters from it
        resumed = torchrun("-m", "prefixgym", "train", "--out", str(out), "--resume",
                           "--steps", "3", "--sampler-url", urls[0])
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        assert resumed.stderr.count("resuming from") == 1
        lines = [json.loads(line) for line in (out / "metrics.jsonl").open()]
        grpo = [r for r in lines if r["phase"] == "grpo"]
        assert [r["step"] for r in grpo] == [0, 1, 2]
        assert grpo[2]["sampler/version_lag"] == 0 and grpo[2]["sampler/max_logprob_gap"] < 1e-3
        assert (out / "checkpoints" / "latest").read_text().strip() == "step-000002"
        models = loaded_models(urls[0])
        assert models is not None and models[0] == "tiny" and len(models) == 3
        assert not set(models) & set(label), models  # this process's two newest only
    finally:
        for server in started:
            server.stop()


if __name__ == "__main__":
    worker(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
