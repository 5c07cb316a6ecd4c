"""The model's text format, shared by the server and the offline tasks: the V4 chat format
(`format`: messages -> prompt, special tokens), DSML tool-call markup (`dsml`), and the split of a
streamed reply into reasoning, content and tool calls (`replies`)."""
