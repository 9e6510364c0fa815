"""Reinforcement learning with verifiable rewards: the rewards, the rollouts and the
run that samples and trains on them (``docs/rl.md``)."""
