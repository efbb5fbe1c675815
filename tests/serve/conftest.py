"""The vLLM tests' shared fixtures (vllm_fixtures.py), registered once for the folder: a session fixture imported
into several test modules is a fixture of each module, and was built once per module (the tiny checkpoints and their
maps five times, one engine pool per module)."""

from vllm_fixtures import engines, smollm2_maps, vllm_hybrid, vllm_lookback, vllm_tiny, vllm_tuned  # noqa: F401
