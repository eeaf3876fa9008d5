"""Adaptive rollout: the vLLM engine wiring (engine/), and later the SD policy and bandit."""
