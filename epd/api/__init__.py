"""HTTP API (OpenAI-compatible) served by the launcher's process."""
