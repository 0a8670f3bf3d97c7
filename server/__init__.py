"""jaxserve's OpenAI-compatible HTTP frontend (layers L0-L1 and the control plane)."""
