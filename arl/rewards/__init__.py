"""Python reward functions: plain-Python scorers of a batch of episodes, run on the host
(`arl.rewards.functions.RewardFunctions`; `config.reward.functions`, checked by
`arl.config.reward` and called inside the step by `arl.trainers.python_rewards`)."""
