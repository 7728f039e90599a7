"""The scheduler: blocks, scheduling, preemption, prefix caching, beam search, resumption, the engine request."""
