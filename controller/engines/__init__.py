"""One vLLM server: the HTTP adapter, its argv and environment, launching, the keeper, sockets."""
