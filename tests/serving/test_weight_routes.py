"""`prefixgym serve`'s weight routes: full weights from disk, versions on answers, adapters."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from starlette.testclient import TestClient  # noqa: E402

from prefixgym.engine.model import load_model  # noqa: E402
from prefixgym.engine.model.hf_export import save_hf_checkpoint  # noqa: E402
from prefixgym.engine.service import EngineService  # noqa: E402
from prefixgym.local_service import LocalService  # noqa: E402
from prefixgym.serving.app import create_app  # noqa: E402
from prefixgym.serving.config import ServeConfig  # noqa: E402

PROMPT = [(5 * i + 7) % 4000 + 50 for i in range(20)]


@pytest.fixture
def served() -> Iterator[tuple[TestClient, LocalService]]:
    service = LocalService(model="tiny", seed=0)
    with TestClient(create_app(service, service.tokenizer, ServeConfig(max_n=4))) as client:
        yield client, service
    service.close()


def complete(client: TestClient, **extra: object) -> dict:
    reply = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3,
                                                  "temperature": 0, "logprobs": 1, **extra})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_update_from_disk_changes_what_is_sampled_and_the_version(served, tmp_path) -> None:
    client, _ = served
    assert complete(client)["metadata"] == {"weight_version": "default"}
    assert client.get("/get_weight_version").json() == {"weight_version": "default"}
    trained = load_model("tiny", seed=7)
    save_hf_checkpoint(trained, tmp_path / "w")

    reply = client.post("/update_weights_from_disk",
                        json={"model_path": str(tmp_path / "w"), "weight_version": "run-1"})
    assert reply.status_code == 200 and reply.json()["success"] is True
    answer = complete(client)
    assert answer["metadata"] == {"weight_version": "run-1"}
    assert client.get("/get_weight_version").json() == {"weight_version": "run-1"}
    # the new answers are the checkpoint's: same greedy tokens and logprobs as in-process
    with EngineService(trained) as reference:
        ids = answer["choices"][0]["token_ids"]
        want = reference.create_sampling_client().compute_logprobs(PROMPT + ids).result()
    got = answer["choices"][0]["logprobs"]["token_logprobs"]
    assert got == pytest.approx(want[len(PROMPT):], abs=1e-4)

    # no label given: the engine's version number
    reply = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "w")})
    assert reply.json()["success"] is True and complete(client)["metadata"]["weight_version"] == "2"


def test_unreadable_or_foreign_weights_are_refused_and_serving_goes_on(served, tmp_path) -> None:
    client, _ = served
    missing = client.post("/update_weights_from_disk",
                          json={"model_path": str(tmp_path / "nowhere"), "weight_version": "x"})
    assert missing.status_code == 400
    body = missing.json()
    assert body["success"] is False and "does not exist" in body["message"]
    assert "share a filesystem" in body["message"]
    save_hf_checkpoint(load_model("small", seed=0), tmp_path / "small")
    foreign = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "small")})
    assert foreign.status_code == 400 and "different model" in foreign.json()["message"]
    (tmp_path / "empty").mkdir()
    empty = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "empty")})
    assert empty.status_code == 400 and "config.json" in empty.json()["message"]
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked"
        save_hf_checkpoint(load_model("tiny", seed=1), locked)
        locked.chmod(0)
        try:
            denied = client.post("/update_weights_from_disk", json={"model_path": str(locked)})
        finally:
            locked.chmod(0o755)
        assert denied.status_code == 400 and "may not read" in denied.json()["message"]
    bad = client.post("/update_weights_from_disk", json={"weight_version": "x"})
    assert bad.status_code == 400 and "model_path" in bad.json()["message"]
    assert complete(client)["metadata"] == {"weight_version": "default"}


def test_adapter_routes_refuse_what_is_not_an_adapter(served, tmp_path) -> None:
    client, _ = served
    reply = client.post("/v1/load_lora_adapter",
                        json={"lora_name": "step-1", "lora_path": str(tmp_path)})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "lora_path"
    missing = client.post("/load_lora_adapter",
                          json={"lora_name": "a", "lora_path": str(tmp_path / "none")})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert gone.status_code == 404
    assert client.post("/v1/completions", json={"prompt": [1], "model": "a"}).status_code == 404


def _trained_adapter(service: LocalService, path: Path) -> list[float]:
    """Ten LoRA steps with a large lr, saved in PEFT format at `path`; the greedy
    logprobs of the trained weights on PROMPT (what the served adapter must give)."""
    import prefixgym as pg

    lora = service.create_lora_training_client(rank=4, seed=0)
    datum = pg.Datum(model_input=pg.ModelInput(tokens=PROMPT[:-1]),
                     loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * 19})
    for _ in range(10):
        lora.forward_backward([datum], loss_fn="cross_entropy").result()
        lora.optim_step(pg.AdamParams(learning_rate=0.05)).result()
    lora.save_weights_for_sampler(path).result()
    sampler = lora.save_weights_and_get_sampling_client()
    reply = sampler.sample(pg.ModelInput(tokens=PROMPT), num_samples=1,
                           sampling_params=pg.SamplingParams(max_tokens=3, temperature=0.0)).result()
    return list(reply.sequences[0].logprobs)


def test_adapters_are_served_by_name_and_unloaded(tmp_path: Path) -> None:
    service = LocalService(model="tiny", seed=0)
    with TestClient(create_app(service, service.tokenizer, ServeConfig())) as client:
        base = complete(client)
    expected = _trained_adapter(service, tmp_path / "adapter")
    adapter = str(tmp_path / "adapter")
    with TestClient(create_app(service, service.tokenizer, ServeConfig())) as client:
        for name in ("step-1", "step-2"):
            reply = client.post("/v1/load_lora_adapter",
                                json={"lora_name": name, "lora_path": adapter})
            assert reply.status_code == 200 and name in reply.text
        again = client.post("/v1/load_lora_adapter",
                            json={"lora_name": "step-1", "lora_path": adapter})
        assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [
            "tiny", "step-1", "step-2"]
        answer = complete(client, model="step-2")
        assert answer["model"] == "step-2" and answer["metadata"]["weight_version"] == "step-2"
        served = answer["choices"][0]["logprobs"]["token_logprobs"]
        assert served == pytest.approx(expected, abs=1e-4)
        assert served != pytest.approx(base["choices"][0]["logprobs"]["token_logprobs"], abs=1e-3)
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "step-1"}).status_code == 200
        assert client.post("/v1/completions",
                           json={"prompt": [1], "model": "step-1"}).status_code == 404
    service.close()


def test_weight_routes_want_the_api_key(tmp_path: Path) -> None:
    service = LocalService(model="tiny", seed=0)
    app = create_app(service, service.tokenizer, ServeConfig(api_key="s3cret"))
    with TestClient(app) as client:
        for route, body in [("/update_weights_from_disk", {"model_path": str(tmp_path)}),
                            ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "."}),
                            ("/v1/unload_lora_adapter", {"lora_name": "a"})]:
            assert client.post(route, json=body).status_code == 401, route
        assert client.get("/get_weight_version").status_code == 401
        keyed = client.get("/get_weight_version", headers={"Authorization": "Bearer s3cret"})
        assert keyed.status_code == 200
    assert service.weights_version == 0
    service.close()
