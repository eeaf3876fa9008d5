"""When to speculate during rollout: a batch-size threshold, and below it a bandit per bucket.

    policy = AdaptiveSDPolicy(SDPolicyConfig(), max_k=engine_k)
    engine.set_sd_schedule(policy.schedule())          # before generation
    policy.observe(engine.take_sd_metrics())           # every so often
    engine.set_sd_schedule(policy.schedule())          # the arms the bandit picked next
"""
from tlt_verl.rollout.policy.bandit import BanditConfig, BucketedEpsilonGreedy
from tlt_verl.rollout.policy.sd_policy import AdaptiveSDPolicy, SDPolicyConfig, StepMetric

__all__ = ["AdaptiveSDPolicy", "BanditConfig", "BucketedEpsilonGreedy", "SDPolicyConfig", "StepMetric"]
