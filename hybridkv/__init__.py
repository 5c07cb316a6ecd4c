"""hybridkv: DeepSeek-V4-family long-context models and their memory system."""

__version__ = "0.1.0"
