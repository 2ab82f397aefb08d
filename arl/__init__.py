"""arl: JAX-native, functional agentic reinforcement learning."""

__version__ = "0.1.0"
