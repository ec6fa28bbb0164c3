"""HTTP: the engine's OpenAI-style server, the P/D proxy, metrics."""
