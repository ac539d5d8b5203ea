"""The sweep loop and the executors that run job bodies out of process (locally or on Ray)."""
