"""verl's synchronous replay buffer, polled every 0.1 s instead of every 2 s.

verl's V1 `ReplayBuffer.sample` sleeps `poll_interval` (2.0 s, not a config option) between looks
at the finished rollouts, so a step's `gen` time is rounded up to the next multiple of 2 s after the
last response arrives: on the tiny CPU recipe the rollout window was 4.0-5.1 s and `gen` a flat 6.0
s. That hides any change in rollout speed under 2 s, and TLT's speed-up is such a change. The tiny
recipes plug this class in through verl's own extension point
(`trainer.v1.sampler.custom_sampler.{path,name}`) for every run, TLT on or off, so that both arms of
a comparison sample the same way. A look costs one metadata sync with TransferQueue (a few ms).

verl hands a custom sampler none of the group-filtering (DAPO) options, so a recipe that sets
`algorithm.filter_groups` must keep verl's own sampler; the tiny recipes filter nothing.
"""
from __future__ import annotations

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

from tlt_verl.patches import require_attr

OPTION = "trainer.v1.sampler.sampler_kwargs"
DEFAULT_POLL_INTERVAL_S = 0.1
# verl's path to this class, for recipes: trainer.v1.sampler.custom_sampler.path / .name
CUSTOM_SAMPLER = ("pkg://tlt_verl.launch.sampler", "FastPollReplayBuffer")


class FastPollReplayBuffer(ReplayBuffer):
    def __init__(self, trainer_mode: str, sampler_kwargs=None, **kwargs):
        if trainer_mode != "sync":
            raise ValueError(f"trainer.v1.trainer_mode={trainer_mode}: the fast-poll sampler "
                             f"({CUSTOM_SAMPLER[0]}) is verl's synchronous replay buffer; drop it for other modes")
        options = dict(sampler_kwargs or {})
        interval = options.pop("poll_interval_s", DEFAULT_POLL_INTERVAL_S)
        if options:
            raise ValueError(f"{OPTION}: unknown option(s) {sorted(options)} (the fast-poll sampler takes poll_interval_s)")
        if not isinstance(interval, (int, float)) or not 0 < interval <= 10:
            raise ValueError(f"{OPTION}.poll_interval_s={interval}: must be a number of seconds in (0, 10]")
        super().__init__(trainer_mode=trainer_mode, sampler_kwargs=sampler_kwargs, poll_interval=float(interval),
                         **kwargs)
        # What this class changes must still be what `sample` sleeps on.
        require_attr(self, "poll_interval", "fast-poll replay buffer")
