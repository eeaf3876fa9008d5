"""The Spot Trainer: drafter training on rollout workers while they sit idle in the long tail."""
