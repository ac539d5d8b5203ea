"""`codesign profile`'s measurement: the devices at hand, as the cost model needs them.

Runs in its own process (`python -m codesign.engine.probe OUT.json`, entry.py), the platform and
the virtual device count set in the environment before JAX starts. Each section's result is kept
in OUT.json.parts as it comes (parts.py), and a run that finds that file reuses what it holds.

On a GPU (gpu_sections.py) every figure is device time, timed inside one compiled loop
(loops.py): large matmuls per precision, a stream far past L2, each ZHEN mixer (mixers.py)
forward and backward at a grid of widths and micro-batch sizes, and with several GPUs the
collectives as nccl-tests report them. Nothing is calibrated: device time is what the cost model
adds up. NVML's energy counter, read over a window of the matmul, stream and all-reduce loops and
of doing nothing, gives the profile's power model (power.py).

On CPU (cpu_profile.py) the devices are virtual and share the machine's cores: micro-benchmarks
per call (cpu_benchmarks.py), then a fit to real training steps of the probe jobs, each timed as
a sweep runs it, in a process that sees as many virtual devices as the step uses (probe_steps.py).
"""
