"""The engine: wire frames, the payload table, floating messages, the compute list, the big loop."""
