"""`prefixgym train --sampler-url` against a real vLLM (0.32, CPU build, in .venv-vllm):
full weights reloaded in place through vLLM's development routes and LoRA adapters
through its runtime adapter routes, both sampled on-policy; the served weights equal
the trainer's; a resumed run unloads the adapters its first process left; vLLM's
prefix cache reports hits; an agent program's calls (--agent) sample there on-policy,
and `prefixgym proxy` in front of it records what it sampled.
(Async LoRA against vLLM: test_remote_training.py; two servers under torchrun with one
killed: test_scale_out.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from agent_envs import Lengthy

from prefixgym.cli import main as cli_main
from prefixgym.cli.train import build_run, unwrap
from prefixgym.engine.model import load_model
from prefixgym.serving.openai_client import OpenAISamplingClient
from prefixgym.serving.pool import AllSamplersFailed, SamplerPool
from prefixgym.trainer.config import TrainConfig

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm")]

PROMPT = [7, 8, 9, 10, 11, 12, 13, 14]


class Wordy(Lengthy):
    """Lengthy with a system prompt longer than vLLM's 32-token blocks, which it caches
    whole: every prompt then shares at least one block with the others."""

    system_prompt = ("You are a patient assistant in a test of prefix caching. Reply with "
                     "anything at all: a word, a number, or a short sentence will do. The "
                     "reward depends only on the length of what you say.")


def config_for(out: Path, url: str, **changes) -> TrainConfig:  # type: ignore[no-untyped-def]
    """Trained in float32, as vLLM serves: what is tested is that vLLM reproduces the
    pushed weights (a bf16 trainer's own rounding is tests/numerics.py's subject)."""
    fields = dict(out=str(out), env="tests/Lengthy-v0", sft_steps=0, steps=2,
                  groups_per_step=2, group_size=2, eval_episodes=2, eval_every=10,
                  checkpoint_every=1, max_tokens=4, progress=False, lr=0.05,
                  lr_schedule="constant", sampler_url=[url + "/v1"],
                  compute_dtype="float32")
    return TrainConfig(**{**fields, **changes})


def grpo_records(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    return [r for r in lines if r["phase"] == "grpo"]


def trainer_logprobs(model: torch.nn.Module, prompt: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0].float().log_softmax(-1)
    return [float(logits[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]


def served_logprobs(url: str, prompt: list[int], model: str | None = None) -> list[float]:
    with OpenAISamplingClient(url) as client:  # model None: the served base
        values, _ = client.prompt_logprobs_now(prompt, model)
    return [float(v) for v in values[1:] if v is not None]


def test_a_full_weights_run_samples_on_policy_from_vllm(vllm, tmp_path: Path) -> None:
    run, service = build_run(config_for(tmp_path, vllm.url))
    run.run()
    steps = grpo_records(tmp_path)
    assert [r["sampler/version_lag"] for r in steps] == [0.0, 0.0]
    assert all(r["episodes/off_policy"] == 0 and r["episodes/failed"] == 0 for r in steps)
    bound = 1e-3
    assert all(r["sampler/max_logprob_gap"] < bound for r in steps)
    # vLLM holds the trainer's last weights under the last label: the command's, the
    # run start's and one per step were pushed
    with OpenAISamplingClient(vllm.url) as client:
        label = client.served_weights_version()
    assert label is not None and label.endswith("-4")
    trained = unwrap(run.training).model
    served = served_logprobs(vllm.url, PROMPT)
    assert served == pytest.approx(trainer_logprobs(trained, PROMPT), abs=1e-4)
    base = trainer_logprobs(load_model("tiny", seed=0), PROMPT)
    assert served != pytest.approx(base, abs=1e-3)  # the push changed what vLLM answers
    service.close()
    # vLLM's answers carry no label; a sampler pinned to other weights asks /weight_info
    # and refuses them
    pool = SamplerPool([OpenAISamplingClient(vllm.url, model="tiny")])
    with pytest.raises(AllSamplersFailed, match=f"answered from weights '{label}'"):
        pool.pinned("another-run-1", 1).sample(PROMPT, 1).result()
    pool.close()


def test_a_lora_run_samples_on_policy_from_vllm_and_resumes(vllm, tmp_path: Path) -> None:
    run, service = build_run(config_for(tmp_path, vllm.url, lora_rank=4,
                                        env=f"{__file__}:Wordy"))
    run.run()
    steps = grpo_records(tmp_path)
    assert [r["sampler/version_lag"] for r in steps] == [0.0, 0.0]
    bound = 1e-3
    assert all(r["sampler/max_logprob_gap"] < bound for r in steps)
    # vLLM's prefix cache served part of the prompts (an episode's second turn extends
    # its first; a group's samples share one prompt), and the run counted it
    assert all(r["tokens/prefill_cached"] > 0 and r["sampler/0/hit_rate"] > 0 for r in steps)
    with OpenAISamplingClient(vllm.url) as client:
        adapters = client.loaded_adapters()
    # the newest two adapters, loaded from the run's sampler_weights
    assert len(adapters) == 2
    assert all(Path(p).is_relative_to(tmp_path / "sampler_weights") for p in adapters.values())
    newest = max(adapters, key=lambda name: int(name.rsplit("-", 1)[1]))
    trained = unwrap(run.training).model
    served = served_logprobs(vllm.url, PROMPT, model=newest)
    assert served == pytest.approx(trainer_logprobs(trained, PROMPT), abs=1e-4)
    base = trainer_logprobs(load_model("tiny", seed=0), PROMPT)
    assert served != pytest.approx(base, abs=1e-3)  # the adapter changed the answer
    service.close()

    # a second process of the run: its own labels; it unloads the first one's adapters
    assert cli_main(["train", "--out", str(tmp_path), "--resume", "--steps", "3",
                     "--compute-dtype", "float32", "--no-progress"]) == 0
    steps = grpo_records(tmp_path)
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert steps[2]["sampler/version_lag"] == 0 and steps[2]["sampler/max_logprob_gap"] < bound
    with OpenAISamplingClient(vllm.url) as client:
        resumed = client.loaded_adapters()
    assert len(resumed) == 2 and not set(resumed) & set(adapters)


AGENT = '''
from openai import OpenAI

def agent(base_url, api_key, model, task):
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task}]
    reply = client.chat.completions.create(model=model, messages=messages)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "Once more."}]
    again = client.chat.completions.create(model=model, messages=messages)
    return float(sum(again.choices[0].token_ids) % 7)  # (rewards that differ in a group)
'''


def test_an_agent_program_samples_on_policy_from_vllm(vllm, tmp_path: Path) -> None:
    """--agent with --sampler-url: the program's calls go through the gateway to vLLM,
    which holds the trainer's weights; the recorded tokens train on-policy."""
    pytest.importorskip("openai")
    (tmp_path / "agent.py").write_text(AGENT)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(f"Say something about {i}.") + "\n" for i in range(3)))
    out = tmp_path / "run"
    run, service = build_run(config_for(out, vllm.url, agent=f"{tmp_path / 'agent.py'}:agent",
                                        tasks=str(tasks), checkpoint_every=10))
    run.run()
    steps = grpo_records(out)
    assert [r["sampler/version_lag"] for r in steps] == [0.0, 0.0]
    assert all(r["episodes/failed"] == 0 for r in steps)
    trained = [r for r in steps if r["datums/count"] > 0]  # (a group of equal rewards skips)
    assert trained and all(r["sampler/max_logprob_gap"] < 1e-3 for r in trained)
    service.close()


def test_the_proxy_records_what_vllm_sampled(vllm, tmp_path: Path) -> None:
    """`prefixgym proxy --upstream <vLLM>`: a program's two calls are recorded as the ids
    vLLM returned, the second prompt extending the first prompt and reply token for
    token."""
    openai = pytest.importorskip("openai")
    from prefixgym.cli.proxy import ProxyConfig, build_proxy

    record = tmp_path / "sessions.jsonl"
    proxy = build_proxy(ProxyConfig(upstream=vllm.url, port=0, record=str(record),
                                    max_tokens=8))
    proxy.start()
    try:
        client = openai.OpenAI(base_url=proxy.gateway.url + "/v1", api_key="none",
                               max_retries=0)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Name a colour."}]
        choices = []
        for turn in range(2):
            reply = client.chat.completions.create(model=model, messages=messages)
            choices.append(reply.choices[0])
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": f"Another one ({turn})."}]
    finally:
        proxy.stop()  # (ends the session: its sequence is written)
    [line] = [json.loads(x) for x in record.read_text().splitlines()]
    sampled = [c.model_extra["token_ids"] for c in choices]
    prompts = [c.model_extra["prompt_token_ids"] for c in choices]
    tokens, mask = line["tokens"], line["sampled_mask"]
    assert [t for t, m in zip(tokens, mask) if m] == [t for ids in sampled for t in ids]
    assert prompts[1][:len(prompts[0]) + len(sampled[0])] == prompts[0] + sampled[0]
    for turn, ids in zip(line["turns"], sampled):
        assert tokens[turn["reply_start"]:turn["reply_end"]] == ids
