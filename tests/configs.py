"""Small configs the tests and the fault bench share (no pytest here: bench/bench_faults.py imports it)."""

# A model small enough to compile and run in seconds on virtual CPU devices.
SMALL_HEAD = """
[training_spec]
avg_batch_size_per_device = 4
num_iters = 3

[[model]]
num_features = 8
emb_dim = 4
output_per_emb = 2
num_zhen_layers = 1
tokens = ["LINEAR", "DOT"]
"""

# One virtual CPU device.
ONE_CPU_DEVICE = """
[[cluster_spec]]
num_hosts = 1
num_devices_per_host = 1
transport = "NVLink"
platform = "cpu"
"""

# Two virtual CPU devices of one host.
TWO_CPU_DEVICES = """
[[cluster_spec]]
num_hosts = 1
num_devices_per_host = 2
transport = "NVLink"
platform = "cpu"
"""

# Every mixer kind in each of two layers: pp 2 splits it, and each plan compiles in seconds.
EVERY_MIXER_MODEL = """
[[model]]
num_features = 16
emb_dim = 8
output_per_emb = 4
num_zhen_layers = 2
tokens = ["DOT", "ATTENTION", "LINEAR", "CONVOLUTION"]
"""

# One job runs, one is invalid (global batch 8 over 3 micro-batches).
SMALL_CONFIG = SMALL_HEAD + TWO_CPU_DEVICES + """
[[parallel_spec]]
description = "data parallel"
num_micro_batches = [1, 3]
"(pp, dp, op)" = [1, 2, 1]
"""
