"""The public front: the offline LLM API, the pagedserve CLI at start-up, options as flags and variables."""
