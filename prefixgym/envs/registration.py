"""Which env an `--env` string names, and making it: ids, modules, classes, files.

    make_env("prefixgym/GuessNumber-v0")              # a registered Gymnasium id
    make_env("my_envs:myenvs/Hangman-v0")              # import my_envs (it registers), then the id
    make_env("my_envs:Hangman")                        # a class in a module
    make_env("path/to/hangman.py:Hangman", {"max_turns": 8})   # a class in a file
    make_env("reasoning_gym:leg_counting", {"max_animals": 3})  # another ecosystem's env

Another ecosystem's envs go by its prefix, up to the first colon (`envs/ecosystems/`).
Modules are looked up on `sys.path` and in the working directory (the `prefixgym`
console script does not put it there itself). Installed packages can make their ids
available with an entry point in the `prefixgym.envs` group, the env id as its name
and `module:Class` as its value:

    [project.entry-points."prefixgym.envs"]
    "myenvs/Hangman-v0" = "my_envs.hangman:Hangman"

`register_envs()` registers the built-in ids ("prefixgym/<Name>-v0") and those entry
points with Gymnasium; it runs when `prefixgym` is imported and is idempotent. Turn
limits live in the env (`max_turns`), so no TimeLimit wrapper is added. Every failure
is one ValueError that names the string. Knows Gymnasium and Python's import system;
nothing of tokens.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import gymnasium as gym

from prefixgym.envs.ecosystems import ecosystem_of, make_ecosystem_env

if TYPE_CHECKING:  # `import prefixgym` registers ids without loading the envs
    from prefixgym.envs.base import Observation

BUILTIN_ENVS: dict[str, str] = {
    "prefixgym/GuessNumber-v0": "prefixgym.envs.guess_number:GuessNumber",
    "prefixgym/Arithmetic-v0": "prefixgym.envs.arithmetic:Arithmetic",
    "prefixgym/Addition-v0": "prefixgym.envs.addition:Addition",
    "prefixgym/Mastermind-v0": "prefixgym.envs.mastermind:Mastermind",
    "prefixgym/GridMaze-v0": "prefixgym.envs.grid_maze:GridMaze",
    "prefixgym/KeyValueLookup-v0": "prefixgym.envs.key_value_lookup:KeyValueLookup",
}
ENTRY_POINT_GROUP = "prefixgym.envs"

EnvKwargs = Mapping[str, Any]  # an env constructor's keyword arguments: any types
AnyEnv = gym.Env[Any, Any]  # any env: its own spaces decide its types


def register_envs() -> None:
    """Register the built-in ids and the `prefixgym.envs` entry points (once each)."""
    for env_id, entry_point in BUILTIN_ENVS.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=entry_point)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in gym.registry:
            gym.register(id=ep.name, entry_point=ep.value)


def make_env(spec: str, kwargs: EnvKwargs | None = None) -> AnyEnv:
    """The env `spec` names, made with `kwargs`: `ID`, `module:ID`, `module:Class` or
    `path/to/file.py:Class` (see the module docstring). ValueError when it cannot be."""
    register_envs()
    kwargs = dict(kwargs or {})
    source, _, name = spec.rpartition(":")
    try:
        if ecosystem_of(spec) is not None:  # reasoning_gym:TASK, ...: their own adapters
            env: AnyEnv = make_ecosystem_env(spec, kwargs)
            return env
        if not source:
            try:
                return gym.make(spec, **kwargs)
            except (gym.error.NameNotFound, gym.error.NamespaceNotFound,
                    gym.error.VersionNotFound):
                raise ValueError(_unknown_id(spec)) from None
        module = import_source(source)
        target = getattr(module, name, None)
        if isinstance(target, type):
            if not issubclass(target, gym.Env):
                raise ValueError(f"{name} in {source} is not a gymnasium.Env subclass")
            env = target(**kwargs)
            return env
        if target is None and name not in gym.registry:
            raise ValueError(f"{source} has no class {name!r}, and no env id {name!r} is "
                             "registered")
        return gym.make(name, **kwargs)  # an id the module registered when imported
    except (gym.error.Error, TypeError, ValueError) as e:  # unknown id, bad kwargs, ...
        raise ValueError(f"cannot make env {spec!r} with {kwargs}: {e}") from None
    except Exception as e:  # the env's own code failed: say where, in one line
        raise ValueError(f"cannot make env {spec!r} with {kwargs}: {_located(e)}") from None


def absolute_spec(spec: str) -> str:
    """`spec` with a relative `file.py` made absolute, so it still names the same file
    from another working directory (what a run saves for --resume and rollout --run)."""
    source, sep, name = spec.rpartition(":")
    if source.endswith(".py") and not Path(source).is_absolute():
        return f"{Path(source).resolve()}{sep}{name}"
    return spec


def close_all(envs: Iterable[AnyEnv]) -> None:
    """Close every env (their server sessions, files, processes); one that fails to
    close is said in a warning, and the others are closed still."""
    for env in envs:
        try:
            env.close()
        except Exception as e:  # noqa: BLE001 - closing is best effort, and says so
            warnings.warn(f"closing env {env}: {_located(e)}", stacklevel=2)


def make_agent_env(spec: str, kwargs: EnvKwargs | None = None) -> gym.Env[Observation, str]:
    """`make_env`, refusing (ValueError) an env that is not a prefixgym `AgentEnv`."""
    from prefixgym.envs.base import agent_of

    env = make_env(spec, kwargs)
    agent_of(env)
    return env


def import_source(source: str) -> ModuleType:
    """The module a `module:name` or `path/to/file.py:name` spec's left side names: a
    module by name (the working directory importable too) or a `.py` file by path;
    ValueError for one that does not exist."""
    if source.endswith(".py"):
        return _import_file(Path(source))
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)  # after the installed packages: it never shadows them
    try:
        return importlib.import_module(source)
    except ModuleNotFoundError as e:
        if e.name is not None and source.startswith(e.name):
            raise ValueError(
                f"no module named {e.name!r} (looked in the working directory {cwd} and the "
                "installed packages); for a file, write path/to/file.py:Class"
            ) from None
        raise  # the module exists but imports something missing: its own error


def located(error: Exception) -> str:
    """`Type: message (file:line)` of the innermost frame that raised `error`."""
    return _located(error)


def _unknown_id(spec: str) -> str:
    """What to say of an id no env is registered under: the built-in ids (the one the
    spec spells otherwise first, e.g. 'guess_number' for GuessNumber), and the forms."""
    def simple(name: str) -> str:
        return "".join(c for c in name.rpartition("/")[2].split("-v")[0].lower() if c.isalnum())

    near = [i for i in BUILTIN_ENVS if simple(i) == simple(spec)]
    hint = f"did you mean {near[0]!r}? " if near else ""
    return (f"no env id {spec!r} is registered; {hint}the built-in envs are "
            f"{', '.join(BUILTIN_ENVS)}; an env can also be module:ID, module:Class or "
            "path/to/file.py:Class")


def _located(error: Exception) -> str:
    """`Type: message (file:line)` of the innermost frame that raised `error`."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    where = f" ({frame.tb_frame.f_code.co_filename}:{frame.tb_lineno})" if frame else ""
    return f"{type(error).__name__}: {error}{where}"


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise ValueError(f"no file {str(path)!r}")
    resolved = path.resolve()
    name = f"prefixgym_env_file_{abs(hash(str(resolved))):x}"
    if name in sys.modules:
        return sys.modules[name]
    file_spec = importlib.util.spec_from_file_location(name, resolved)
    if file_spec is None or file_spec.loader is None:
        raise ValueError(f"cannot import {str(path)!r} as a Python file")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    try:
        file_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
