"""Slow learning tests on multi-turn token environments (docs/learning.md).

Each test runs the two stages of `experiments.learning_stages` with the shipped config
and its `warm_start` section (fixed seeds): behaviour cloning on the environment's *weaker*
demonstrator, then RL from those weights. Thresholds sit a little below the measured
numbers (docs/learning.md, "Measured results"); every test also checks the baselines (the
random policy never succeeds; the demonstrator and the oracle are what they are
documented to be) and that RL improved on the SFT-only policy.

    pytest -m slow tests/test_learning_token_slow.py -n 0 -p no:cacheprovider
"""

import pytest

from tests.learning_runs import run_shipped_config


@pytest.mark.slow
def test_grpo_guess_number_16_sft_then_rl():
    r = run_shipped_config("grpo_guess_number")
    assert r["random_sampled"][0] < 0.05
    assert r["oracle"][0] == 1.0
    sft_sampled, sft_turns = r["sft_sampled"]
    rl_sampled, rl_turns = r["rl_sampled"]
    # Measured (seed 0): SFT alone 0.89 sampled / 1.0 greedy; SFT + RL 0.945 / 1.0.
    assert rl_sampled >= 0.9, r
    assert rl_sampled > sft_sampled + 0.02, r
    assert rl_turns < sft_turns, r
    assert r["rl_greedy"][0] >= 0.95, r


@pytest.mark.slow
def test_grpo_calculator_2_digit_learns_to_use_the_tool():
    r = run_shipped_config("grpo_calculator")
    assert r["random_sampled"][0] < 0.05
    assert r["demonstrator"][0] < 0.8  # skips the tool half the time
    # Measured (seed 0): SFT alone 0.16 sampled / 0.01 greedy (it imitates the skipping
    # and cannot do the mental arithmetic); SFT + RL 0.945 / 1.0, always calling the tool.
    assert r["rl_sampled"][0] >= 0.9, r
    assert r["rl_sampled"][0] > r["demonstrator"][0] + 0.1, r
    assert r["rl_sampled"][0] > r["sft_sampled"][0] + 0.1, r
    assert r["rl_greedy"][0] >= 0.9, r


@pytest.mark.slow
def test_ppo_with_critic_learns_guess_number_8():
    r = run_shipped_config("ppo_guess_number")
    assert r["random_sampled"][0] < 0.05
    # Measured (seed 0; the RL stage has no SFT term): SFT alone 0.875 sampled / 0.88
    # greedy, 3.09 turns; SFT + PPO 0.97 / 1.0, 2.80 turns (demonstrator 2.85).
    sft_sampled, sft_turns = r["sft_sampled"]
    rl_sampled, rl_turns = r["rl_sampled"]
    assert rl_sampled >= 0.93, r
    assert rl_sampled > sft_sampled + 0.05, r
    assert rl_turns < sft_turns, r
    assert r["rl_greedy"][0] >= 0.95, r


@pytest.mark.slow
def test_grpo_word_problems_from_a_dataset():
    r = run_shipped_config("grpo_word_problems")
    assert r["random_sampled"][0] < 0.1  # two-digit answers: a random guess sometimes hits
    assert 0.7 < r["demonstrator"][0] < 0.8  # 1 - (1 - 0.5)^2 over two attempts
    assert r["oracle"][0] == 1.0
    # Measured (seed 0, training problems; memorised: held-out problems stay near 0.2,
    # docs/learning.md): SFT alone 0.36 sampled / 0.74 greedy, SFT + GRPO 0.74 / 0.84 with
    # learning_stages on one device; this test (8 fake devices, XLA opt level 0) 0.44 /
    # 0.73 and 0.76 / 0.85 (65 minutes at load average 18).
    assert r["rl_sampled"][0] >= 0.65, r
    assert r["rl_sampled"][0] > r["sft_sampled"][0] + 0.2, r
    assert r["rl_greedy"][0] >= 0.75, r


@pytest.mark.slow
def test_ppo_with_critic_word_problems_from_a_dataset():
    r = run_shipped_config("ppo_word_problems")
    assert r["random_sampled"][0] < 0.1
    # Measured (seed 0, training problems, learning_stages on one device; the stage 1 of
    # grpo_word_problems): SFT alone 0.36 sampled / 0.74 greedy, SFT + PPO 0.86 / 0.91.
    assert r["rl_sampled"][0] >= 0.75, r
    assert r["rl_sampled"][0] > r["sft_sampled"][0] + 0.3, r
    assert r["rl_greedy"][0] >= 0.8, r
