"""A child JAX process's environment: which platform it runs on and, on CPU, how many virtual
devices it sees (XLA reads both once, when JAX starts in the child)."""

from __future__ import annotations

from typing import Mapping

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def device_env(env: Mapping[str, str], platform: str, cpu_devices: int = 1) -> dict[str, str]:
    """env with JAX_PLATFORMS set and, on CPU, XLA_FLAGS asking for cpu_devices devices."""
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    if platform == "cpu":
        flags.append(f"{DEVICE_COUNT_FLAG}={cpu_devices}")
    return {**env, "JAX_PLATFORMS": "cpu" if platform == "cpu" else "cuda", "XLA_FLAGS": " ".join(flags)}
