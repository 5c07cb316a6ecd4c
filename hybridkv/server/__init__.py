"""The OpenAI-compatible server: chat requests to V4 prompts and replies (the format is
`hybridkv.chat`'s), the engine driver thread, Prometheus metrics, and the web page
(`hybridkv serve MODEL_DIR`)."""
