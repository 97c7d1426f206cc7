"""prefixgym.rollouts: episodes of agent envs, recorded as token-level trajectories.

`rollout.Rollouts` runs groups of episodes against any `SamplingClient`;
`expert.play_expert` plays an env's scripted expert the same way; each episode
leaves one `types.Trajectory`. Knows envs and conversations; not the engine, and
not how trajectories are trained on.
"""
