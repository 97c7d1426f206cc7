"""glibc's mmap threshold: fixed once per process by a TrainingClient with
`recompute_activations` (never on the default path), the user's
`MALLOC_MMAP_THRESHOLD_` left standing, a no-op without glibc, and (on glibc) a freed
large block's size is mmapped again instead of coming from the arena; the trim that
ends a checkpoint load runs on glibc only, and a publish's runs on a thread of its own,
one at a time; `import prefixgym` bounds torch's per-shape kernel caches unless the user
set them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from prefixgym.engine import malloc_tuning
from prefixgym.engine.model import ModelConfig, Transformer, init_weights
from prefixgym.engine.trainer.options import TrainerOptions
from prefixgym.engine.trainer.training import TrainingClient
from prefixgym.types import Datum, ModelInput

CONFIG = ModelConfig(vocab_size=97, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64,
                     max_seq_len=16)


class FakeLibc:
    """Records mallopt calls; answers `result` (glibc: 1 on success, 0 on error)."""

    def __init__(self, result: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.trims: list[int] = []
        self.result = result
        self.mallopt = self._mallopt
        self.malloc_trim = self.trims.append

    def _mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.result


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> FakeLibc:
    """A process that has not tried yet, whose libc is a FakeLibc, without the env var."""
    fake = FakeLibc()
    monkeypatch.setattr(malloc_tuning, "_applied", None)
    monkeypatch.setattr(malloc_tuning, "glibc", lambda: fake)
    monkeypatch.delenv(malloc_tuning.ENV_VAR, raising=False)
    return fake


def test_sets_the_threshold_once_per_process(fresh: FakeLibc) -> None:
    assert malloc_tuning.fix_mmap_threshold() is True
    assert malloc_tuning.fix_mmap_threshold() is True
    assert fresh.calls == [(malloc_tuning.M_MMAP_THRESHOLD, 128 * 1024)]


def test_a_refused_setting_says_false_and_is_not_retried(fresh: FakeLibc) -> None:
    fresh.result = 0
    assert malloc_tuning.fix_mmap_threshold() is False
    assert malloc_tuning.fix_mmap_threshold() is False
    assert len(fresh.calls) == 1


def test_the_users_environment_setting_stands(fresh: FakeLibc,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(malloc_tuning.ENV_VAR, "1048576")
    assert malloc_tuning.fix_mmap_threshold() is False
    assert fresh.calls == []


def test_no_op_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(malloc_tuning.platform, "system", lambda: "Darwin")
    assert malloc_tuning.glibc() is None
    monkeypatch.setattr(malloc_tuning, "_applied", None)
    monkeypatch.delenv(malloc_tuning.ENV_VAR, raising=False)
    assert malloc_tuning.fix_mmap_threshold() is False  # and raises nothing


def test_release_free_memory_trims_with_glibc_only(fresh: FakeLibc,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert malloc_tuning.release_free_memory() is True
    assert fresh.trims == [0]
    monkeypatch.setattr(malloc_tuning, "glibc", lambda: None)
    assert malloc_tuning.release_free_memory() is False
    assert fresh.trims == [0]


def test_a_later_release_trims_on_one_thread_at_a_time(
        fresh: FakeLibc, monkeypatch: pytest.MonkeyPatch) -> None:
    go = threading.Event()
    trimmed_on: list[str] = []

    def slow_trim(pad: int) -> None:
        go.wait(timeout=30)
        trimmed_on.append(threading.current_thread().name)
        fresh.trims.append(pad)

    fresh.malloc_trim = slow_trim
    monkeypatch.setattr(malloc_tuning, "_release", None)  # (a real trim an earlier test began)
    first = malloc_tuning.release_free_memory_later()
    assert first is not None and first.daemon
    assert malloc_tuning.release_free_memory_later() is first  # running: none queued
    go.set()
    first.join(timeout=30)
    assert fresh.trims == [0] and trimmed_on == [first.name] != [threading.current_thread().name]
    second = malloc_tuning.release_free_memory_later()
    assert second is not None and second is not first
    second.join(timeout=30)
    assert fresh.trims == [0, 0]
    monkeypatch.setattr(malloc_tuning, "glibc", lambda: None)
    assert malloc_tuning.release_free_memory_later() is None


def test_other_linux_c_libraries_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(malloc_tuning.platform, "system", lambda: "Linux")
    monkeypatch.setattr(malloc_tuning.platform, "libc_ver", lambda: ("", ""))  # e.g. musl
    assert malloc_tuning.glibc() is None


def train_once(client: TrainingClient) -> None:
    datum = Datum(model_input=ModelInput.from_ints([1, 2, 3, 4]),
                  loss_fn_inputs={"target_tokens": [2, 3, 4, 5]})
    client.forward_backward([datum], "cross_entropy").result()


def test_recompute_activations_fixes_it_at_the_first_forward_backward(fresh: FakeLibc) -> None:
    model = Transformer(CONFIG)
    init_weights(model, 0)
    plain = TrainingClient(model)
    train_once(plain)
    assert fresh.calls == []  # the default path leaves glibc's setting alone
    recompute = TrainingClient(model, TrainerOptions(recompute_activations=True))
    assert fresh.calls == []  # not at construction
    train_once(recompute)
    train_once(recompute)
    plain.close()
    recompute.close()
    assert fresh.calls == [(malloc_tuning.M_MMAP_THRESHOLD, 128 * 1024)]


PROBE = """
import ctypes, importlib.util, sys

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

spec = importlib.util.spec_from_file_location("malloc_tuning", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
if sys.argv[2] == "fix":
    assert module.fix_mmap_threshold()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
size = 8 << 20  # above the arena's free space in a fresh interpreter, below 32 MiB
libc.free(libc.malloc(size))  # mapped; the dynamic threshold rises to its size
before = libc.mallinfo2().hblks
block = libc.malloc(size)
print(libc.mallinfo2().hblks - before)
libc.free(block)
"""


@pytest.mark.parametrize(("mode", "mapped"), [("fix", "1"), ("default", "0")])
def test_glibc_maps_a_freed_blocks_size_again(mode: str, mapped: str) -> None:
    """In a fresh interpreter: with glibc's dynamic threshold a freed 8 MiB mapping
    raises it, so the same request then grows the arena; fixed, it is mapped again."""
    libc = malloc_tuning.glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc >= 2.33")
    env = {k: v for k, v in os.environ.items() if k != malloc_tuning.ENV_VAR}
    out = subprocess.run([sys.executable, "-c", PROBE, malloc_tuning.__file__, mode],
                         capture_output=True, text=True, env=env, check=True, timeout=60)
    assert out.stdout.strip() == mapped


@pytest.mark.parametrize("given", [None, "7"])
def test_import_bounds_the_kernel_caches_unless_set(given: str | None) -> None:
    caches = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    env = {k: v for k, v in os.environ.items() if k not in caches}
    if given is not None:
        env.update(dict.fromkeys(caches, given))
    code = "import os, prefixgym; print(*(os.environ[k] for k in %r))" % (caches,)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [given or "64"] * 2
