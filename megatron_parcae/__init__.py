"""megatron-parcae: train megatron-core GPT and BERT models on preemptible (spot) GPUs."""

__version__ = "0.1.0"  # setup.py reads this line without importing the package
