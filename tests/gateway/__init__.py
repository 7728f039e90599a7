"""The gateway: the OpenAI and gRPC APIs over real services, its HTTP server, parsers, pooling, API keys."""
