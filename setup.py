"""Installation script for arl: JAX-native agentic reinforcement learning."""

import setuptools

TRAIN = [
    "flax>=0.10.0",
    "optax>=0.2.4",
    "orbax-checkpoint>=0.11.0",
    "tensorflow-datasets>=4.9.7",
    "ml-collections>=1.0.0",
    "absl-py>=2.1.0",
    "gymnax>=1.0.0",
    "tensorboardX>=2.6",
    "matplotlib>=3.8",
    "grain>=0.2.10",
    "array-record>=0.7.0",
    "importlib_resources>=6.0",  # tfds builders resolve their code path through it
    "tqdm>=4.66",
    "safetensors>=0.4.3",  # Hugging Face checkpoint import/export (numpy API, no torch)
    "tokenizers>=0.19",  # Hugging Face tokenizer.json codecs for the token envs
    "jinja2>=3.1.6",  # checkpoints' chat templates, rendered as transformers does
    "filelock",  # JAX locks (and bounds) the persistent compilation cache with it (arl/caches.py)
    # The tool sandbox's seccomp allowlist (arl/tools/seccomp.py), compiled by the system's
    # libseccomp (libseccomp2: Debian and Ubuntu have it with apt) through this binding.
    "pyseccomp>=0.1.2",
]

DATA = ["pyarrow>=14"]

# Environments of other libraries (arl.envs.tasks: reasoning_gym_task, textarena_game,
# openenv_client), pinned to the releases the adapters were written and tested against.
REASONING_GYM = ["reasoning-gym==0.1.25"]
TEXTARENA = ["textarena==0.7.4"]
OPENENV = ["openenv-core==0.3.0"]

setuptools.setup(
    name="arl",
    version="0.1.0",
    description=(
        "JAX-native, functional agentic RL: PPO/GRPO/ERPO kernels, jittable token "
        "environments and a single compiled rollout+update step."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # The library only: the command lines (experiments/) and the shipped configs
    # (configs/) run from a checkout (`python -m experiments.train --config=configs/...`),
    # so an install claims no generic top-level name such as `experiments` or `configs`.
    packages=setuptools.find_packages(include=["arl", "arl.*"]),
    # The shipped example tasks of the dataset_task environment (arl.data.word_problems).
    package_data={"arl.data": ["*.jsonl"]},
    python_requires=">=3.10",
    # `pip install arl`: the kernels (`arl.algorithms`) alone, to compose into your own
    # JAX code. The `train` extra adds what the trainers, environments, command lines and
    # experiment loop need (`pip install "arl[train]"`); `test` adds the test tools.
    install_requires=[
        "jax>=0.7.0",
        "chex>=0.1.88",
        "numpy>=1.26",
    ],
    extras_require={
        "train": TRAIN,
        # Datasets as users keep them (arl.data.task_files): Parquet files and
        # datasets.save_to_disk directories are read with pyarrow.
        "data": DATA,
        # reasoning_gym:<task> environments (arl.envs.tasks.reasoning_gym_task). Three of
        # its dependencies (pycosat, cellpylib, zss) come as sdists: pycosat builds a C
        # extension, so the install needs a C compiler.
        "reasoning-gym": REASONING_GYM,
        # textarena:<game> single-player games (arl.envs.tasks.textarena_game).
        "textarena": TEXTARENA,
        # openenv:<url or module> environments (arl.envs.tasks.openenv_client).
        "openenv": OPENENV,
        # The adapters' tests run in the default suite, so the test extra installs all three
        # libraries (measured on top of the rest of the test extra: 8 s, 5 s and 6 s from
        # a mirror; openenv-core brings about 50 packages, gradio and fastmcp among them).
        # Without them those tests skip, naming the extra that installs the library.
        "test": TRAIN + DATA + REASONING_GYM + TEXTARENA + OPENENV + [
            "datasets>=2.14",  # writes save_to_disk directories for tests/test_task_files.py
            "sympy>=1.12",  # examples/bring_your_task's reward function
            # The golden runs (tests/test_golden_run.py) compare every metric with values
            # recorded under this JAX: another XLA rounds differently, so the test
            # environment pins the version they were recorded with.
            "jax==0.10.2",
            "jaxlib==0.10.2",
            "pytest>=8.0,<9",  # pytest 9 ignores the node ids xdist uses for --dist loadgroup
            "hypothesis>=6.100",
            "pytest-xdist>=3.5",
            "filelock",  # tests/test_learning_reduced.py: warm start shared by workers
            "rlax>=0.1.6",
            "nbclient>=0.10",
            "nbformat>=5.9",
            "ipykernel>=6.29",
            # HF parity tests only (pytest.importorskip: they skip when absent).
            "torch==2.13.0",
            "transformers>=4.45",
        ],
    },
)
