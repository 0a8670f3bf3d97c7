"""jaxserve's router (L2): one OpenAI-compatible front over several `jaxserve serve` workers."""
