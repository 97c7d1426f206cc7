"""The hosted service's client library, both ways (the optional extra `prefixgym[tinker]`).

- `ServiceClient` (`service_client.py`, `clients.py`): tinker's `ServiceClient` and
  the training and sampling clients it makes, with tinker's types and futures, served
  by a local `LocalService`, so tinker-cookbook code runs here with one line changed.
- `backend.py`: the other way, our rollouts and trainer on the hosted service
  (`prefixgym train --backend tinker`).
`convert.py` converts between the two type systems. Needs the `tinker` package.
"""

from __future__ import annotations

try:
    import tinker as _tinker  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("prefixgym.tinker needs the tinker package: "
                      "pip install 'prefixgym[tinker]'") from e

from prefixgym.tinker.service_client import ServiceClient

__all__ = ["ServiceClient"]
