"""The job body and everything that runs on devices (JAX, Flax, Optax): the pp = 1 step, the
pipeline engine, shardings and state, energy. Only the job process imports this package.
"""
