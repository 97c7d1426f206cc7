"""`--env openenv:URL` against real OpenEnv servers (openenv-core's `create_app`, served
on loopback by uvicorn in a thread): a session per episode, seeds, capacity errors as
env errors, a train step, and an env whose reset ignores its seed refused."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("websockets")
uvicorn = pytest.importorskip("uvicorn")
env_server = pytest.importorskip("openenv.core.env_server.http_server")

from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import Action, State  # noqa: E402
from openenv.core.env_server.types import Observation as EnvObservation  # noqa: E402

from prefixgym.cli import main  # noqa: E402
from prefixgym.cli.flags import field_docs  # noqa: E402
from prefixgym.envs.base import agent_of, replays_its_seed  # noqa: E402
from prefixgym.envs.registration import make_env  # noqa: E402
from prefixgym.local_service import LocalService  # noqa: E402
from prefixgym.rollouts.rollout import RolloutConfig, Rollouts  # noqa: E402
from prefixgym.trainer.config import TrainConfig  # noqa: E402

field_docs(TrainConfig)  # parsed before any server thread runs (see flags._field_docs)


class GuessAction(Action):
    message: str


class GuessObservation(EnvObservation):
    prompt: str = ""
    text: str = ""


class Guess(Environment):
    """Guess a number in 1..8 from 'higher'/'lower'; the reset seed draws it."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        self._state = State(episode_id="", step_count=0)
        self.secret = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        self.secret = random.Random(seed).randint(1, 8)
        self._state = State(episode_id=episode_id or "", step_count=0)
        return GuessObservation(prompt="Guess my number in 1..8.", done=False, reward=0.0)

    def step(self, action: GuessAction, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        guess = int(action.message) if action.message.strip().isdigit() else 0
        if guess == self.secret:
            return GuessObservation(text="Correct.", done=True, reward=1.0)
        hint = "higher" if guess < self.secret else "lower"
        return GuessObservation(text=f"{hint}.", done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


class Unseeded(Guess):
    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        super().reset(seed=None)  # the seed is dropped
        return GuessObservation(prompt=f"Guess my number (game {random.random():.6f}).",
                                done=False, reward=0.0)


class Server:
    def __init__(self, env: type[Environment], sessions: int) -> None:
        app = env_server.create_app(env, GuessAction, GuessObservation, env_name="guess",
                                    max_concurrent_envs=sessions)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "no server"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        assert httpx.get(f"{self.url}/health", timeout=10).status_code == 200

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def guess() -> Iterator[Server]:
    server = Server(Guess, sessions=4)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def one_session() -> Iterator[Server]:
    server = Server(Guess, sessions=1)
    yield server
    server.stop()


def test_an_episode_is_one_session_replayed_by_its_seed(guess: Server) -> None:
    a, b = make_env(f"openenv:{guess.url}"), make_env(f"openenv:{guess.url}")
    (first,), _ = a.reset(seed=3)
    assert first["content"] == "Guess my number in 1..8."
    b.reset(seed=3)
    lo, hi = 1, 8
    for _ in range(8):  # bisect in both: the same secret
        mid = (lo + hi) // 2
        obs, reward, terminated, _, info = a.step(str(mid))
        assert b.step(str(mid))[1:3] == (reward, terminated)
        if terminated:
            break
        lo, hi = (mid + 1, hi) if obs[0]["content"] == "higher." else (lo, mid - 1)
    assert (reward, terminated, info["is_success"]) == (1.0, True, True)
    assert agent_of(a)._socket is None  # the session closed with the episode
    assert replays_its_seed(a)
    a.close()
    b.close()


def test_a_server_at_capacity_ends_that_episode_as_an_env_error(one_session: Server) -> None:
    with LocalService(model="tiny", seed=0) as service:
        rollouts = Rollouts(service.create_sampling_client(), service.tokenizer,
                            RolloutConfig(max_tokens=2))
        envs = [make_env(f"openenv:{one_session.url}") for _ in range(2)]
        group = asyncio.run(rollouts.run_group(envs, 5, "g0"))
    errors = [t for t in group.trajectories if t.failed]
    assert len(errors) == 1 and "Server at capacity: 1/1" in (errors[0].error or "")
    for env in envs:
        env.close()
    again = make_env(f"openenv:{one_session.url}")  # the sessions were all closed
    again.reset(seed=1)
    again.close()


def test_train_runs_an_openenv_env_and_refuses_one_that_ignores_seeds(
        guess: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny = ["--steps", "1", "--sft-steps", "0", "--groups-per-step", "1", "--group-size", "2",
            "--eval-episodes", "2", "--max-tokens", "3", "--no-progress"]
    assert main(["train", "--env", f"openenv:{guess.url}", "--out", str(tmp_path / "a"),
                 *tiny]) == 0
    unseeded = Server(Unseeded, sessions=2)
    try:
        assert main(["train", "--env", f"openenv:{unseeded.url}", "--out",
                     str(tmp_path / "b"), *tiny]) == 2
    finally:
        unseeded.stop()
    assert "ignores its reset seed" in capsys.readouterr().err


@pytest.mark.parametrize(("spec", "kwargs", "message"), [
    ("openenv:localhost:8000", {}, "must start with http://"),
    ("openenv:http://127.0.0.1:9", {"colour": "red"}, "unexpected keyword argument 'colour'"),
])
def test_bad_openenv_specs_are_one_line(spec: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_env(spec, kwargs)
