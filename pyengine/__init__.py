"""pyengine: a single-node LLM inference engine."""
