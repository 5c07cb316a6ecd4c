"""The OpenAI-compatible server: V4 chat format and DSML tool calls, the engine driver thread,
Prometheus metrics, and the web page (`hybridkv serve MODEL_DIR`)."""
