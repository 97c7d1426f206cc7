"""prefixgym's in-process verifiers harness, under the top-level name verifiers loads
harnesses by: `vf-eval NAME --env.agent.harness.id prefixgym_verifiers
--env.agent.runtime.type subprocess ...` runs a taskset's agent as one chat call per
turn in vf-eval's own process (no uv, no program), against any chat-completions URL,
`prefixgym serve` included. `--env verifiers:NAME` uses it too. The harness itself is
`prefixgym.envs.ecosystems.verifiers_env.InProcessHarness`."""

from prefixgym.envs.ecosystems.verifiers_env import InProcessHarness

__all__ = ["InProcessHarness"]
