"""Model code and model files.

- :mod:`epd.models.registry`: which epd LM class runs a checkpoint (``get_model_class``).
- :mod:`epd.models.llama`, :mod:`~epd.models.qwen2`, :mod:`~epd.models.qwen3`: the LMs;
  :mod:`epd.models.loader` loads their weights, :mod:`epd.models.mrope` M-RoPE positions.
- :mod:`epd.models.checkpoints`: locating (and converting) checkpoints on disk; torch-free.
- :mod:`epd.models.tiny`: tiny random checkpoints for tests and benchmarks.

This package's ``__init__`` imports nothing, so that the torch-free modules above stay
cheap to import.
"""
