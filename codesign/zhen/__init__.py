"""The ZHEN model: analytical counts (`counts`, pure), the Flax network (`network`, JAX) and
the model search (`search`, pure). Import the submodule you need; this package imports nothing.
"""
