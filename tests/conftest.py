"""Shared test settings: one torch thread per process, a hypothesis profile sized for
CI, the trainer's compute dtype (`numerics`), and `tests/Lengthy-v0`, an env whose
rewards vary even for an untrained model (for rollout and training tests).

`./run.sh test` runs the suite on two pytest-xdist workers (`-n 2`),
one per core of the CI machine; so each worker, and each process a test starts
(`OMP_NUM_THREADS`, inherited), runs torch on one thread, and the cores are not
oversubscribed. A test that needs more sets torch's count itself and restores it.

No test inherits `--compute-dtype auto`, which would train in bf16 on a CPU with native
bf16 and in fp32 elsewhere: in this process `auto` means the test dtype (fp32, or bf16
with `PREFIXGYM_TEST_DTYPE=bf16`: tests/numerics.py), and a test that starts a training
process passes `--compute-dtype` itself. The header of every run says which CPU this is,
what `auto` would choose on it, and the test dtype."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# device "auto" means the test device (every process a test starts inherits it): the CPU,
# or PREFIXGYM_TEST_DEVICE (cuda, mps) to run the engine and parity tests there
os.environ["PREFIXGYM_DEVICE"] = os.environ.get("PREFIXGYM_TEST_DEVICE", "cpu")
# per-machine caches (the packed weights' thread checks, GGUF conversions) go to the
# checkout's .test-cache, not the user's ~/.cache, unless PREFIXGYM_CACHE_DIR says where
os.environ.setdefault("PREFIXGYM_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(__file__)), ".test-cache"))

import gymnasium as gym  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from agent_envs import Lengthy  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from numerics import TEST_DTYPE_VARIABLE, Numerics, from_environment  # noqa: E402

torch.set_num_threads(1)
settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _test_numerics() -> Numerics:
    try:
        return from_environment()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_sessionstart(session: pytest.Session) -> None:
    """The first lines of a run (CI's included, under -q): the CPU, what `auto` would
    train in on it, and the dtype the tests use."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or hasattr(session.config, "workerinput"):  # an xdist worker
        return
    from prefixgym.engine.device import describe_cpu, has_fast_bf16

    auto = "bfloat16" if has_fast_bf16() else "float32"
    reporter.write_line(f"cpu: {describe_cpu()}: --compute-dtype auto trains in {auto} here")
    if os.environ["PREFIXGYM_DEVICE"] != "cpu":
        reporter.write_line(f"test device: {os.environ['PREFIXGYM_DEVICE']} (PREFIXGYM_TEST_DEVICE)")
    reporter.write_line(f"test dtype: {_test_numerics().name} "
                        f"({TEST_DTYPE_VARIABLE}=fp32|bf16, tests/numerics.py)")


@pytest.fixture(scope="session")
def numerics() -> Numerics:
    """The trainer's compute dtype for tests whose claim holds in either dtype."""
    return _test_numerics()


@pytest.fixture(autouse=True)
def _auto_is_the_test_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    import prefixgym.cli.train as train_command

    is_bf16 = _test_numerics().is_bf16
    monkeypatch.setattr(train_command, "has_fast_bf16", lambda device: is_bf16)


@pytest.fixture(scope="session", autouse=True)
def register_test_envs():
    if "tests/Lengthy-v0" not in gym.registry:
        gym.register("tests/Lengthy-v0", entry_point=Lengthy)


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    """One line each when the real-vLLM tests or the real-model tests were skipped,
    saying how to run them (tests/serving/real_servers.py,
    tests/real_models/real_checkpoints.py)."""
    said = set()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        for kind in ("real-vLLM tests skipped", "real-model tests skipped"):
            if kind in reason and kind not in said:
                said.add(kind)
                terminalreporter.write_line(reason.removeprefix("Skipped: "))
