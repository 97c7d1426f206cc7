"""Envs written for other ecosystems, named by `--env ECOSYSTEM:NAME` alone.

    make_env("reasoning_gym:leg_counting", {"min_animals": 1, "max_animals": 3})
    make_env("textarena:GuessTheNumber-v0-raw")
    make_env("gem:game:GuessTheNumber-v0-easy")      # the name keeps its colon
    make_env("openenv:http://127.0.0.1:8000")         # an OpenEnv server's env
    make_env("verifiers:my_taskset")                   # a verifiers 0.4 taskset module

Each adapter is a prefixgym `AgentEnv` over the ecosystem's own package, an optional
extra (`pip install 'prefixgym[reasoning-gym]'`), imported only when its prefix is
named. The prefix ends at the first colon, so a name may hold colons itself. The
registry (`envs/registration.py`) looks here before the module/class forms.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

ECOSYSTEMS: dict[str, tuple[str, str, str, str]] = {
    # prefix -> (adapter module:class, the library it imports, its package, the pip extra)
    "reasoning_gym": ("prefixgym.envs.ecosystems.reasoning_gym_task:ReasoningGymTask",
                      "reasoning_gym", "reasoning-gym", "reasoning-gym"),
    "textarena": ("prefixgym.envs.ecosystems.games:TextArenaGame", "textarena", "textarena",
                  "textarena"),
    "gem": ("prefixgym.envs.ecosystems.games:GemEnv", "gem", "gem", "gem"),
    "openenv": ("prefixgym.envs.ecosystems.openenv_client:OpenEnvSession",
                "websockets.sync.client", "websockets", "openenv"),
    "verifiers": ("prefixgym.envs.ecosystems.verifiers_env:VerifiersEnv", "verifiers.v1",
                  "verifiers", "verifiers"),
}


def ecosystem_of(spec: str) -> str | None:
    """The ecosystem prefix `spec` names (`PREFIX:NAME`), or None."""
    prefix, sep, name = spec.partition(":")
    return prefix if sep and name and prefix in ECOSYSTEMS else None


def make_ecosystem_env(spec: str, kwargs: Mapping[str, Any]) -> Any:
    """The adapter env of `spec` (`PREFIX:NAME`), made with `kwargs`. ValueError when
    the ecosystem's package is missing (naming the extra that installs it) or refuses
    the name or kwargs."""
    prefix, _, name = spec.partition(":")
    target, library, package, extra = ECOSYSTEMS[prefix]
    try:
        importlib.import_module(library)
    except ImportError:
        raise ValueError(f"{spec} needs the {package} package: pip install "
                         f"'prefixgym[{extra}]'") from None
    module_name, _, class_name = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name).create(name, dict(kwargs))
