"""Shared test settings: one torch thread per process, a hypothesis profile sized for
CI, and `tests/Lengthy-v0`, an env whose rewards vary even for an untrained model (for
rollout and training tests).

`./run.sh test` runs the suite on two pytest-xdist workers (`-n 2`),
one per core of the CI machine; so each worker, and each process a test starts
(`OMP_NUM_THREADS`, inherited), runs torch on one thread, and the cores are not
oversubscribed. A test that needs more sets torch's count itself and restores it."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import gymnasium as gym  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from prefixgym.envs.base import AgentEnv, Outcome  # noqa: E402

torch.set_num_threads(1)
settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


class Lengthy(AgentEnv):
    """Two turns; reward = a function of the reply length, so random replies differ."""

    system_prompt = "Reply with anything."

    def __init__(self, *, raise_on_seed: int | None = None, max_turns: int = 2) -> None:
        super().__init__(max_turns=max_turns)
        self.raise_on_seed = raise_on_seed
        self.seed_used: int | None = None

    def reset(self, *, seed=None, options=None):
        self.seed_used = seed
        return super().reset(seed=seed, options=options)

    def _reset_task(self) -> str:
        return f"Say {int(self.np_random.integers(100))}."

    def _act(self, text: str) -> Outcome:
        if self.raise_on_seed is not None and self.seed_used == self.raise_on_seed:
            raise RuntimeError("this env is broken on purpose")
        reward = (len(text) % 5) / 4
        done = self.turn >= 2
        return Outcome("Again." if not done else "", rewards={"len": reward}, done=done,
                       success=reward > 0.5)

    def expert_action(self) -> str:
        return "abcd"


@pytest.fixture(scope="session", autouse=True)
def register_test_envs():
    if "tests/Lengthy-v0" not in gym.registry:
        gym.register("tests/Lengthy-v0", entry_point=Lengthy)
