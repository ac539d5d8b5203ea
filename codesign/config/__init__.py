"""What the user declares: frozen specs, the TOML loader, job enumeration and keys, hosts.

Pure Python: nothing here imports JAX.
"""
