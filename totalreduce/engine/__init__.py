"""The engine: the compiled lane (every op's data path) and the loop around it."""
