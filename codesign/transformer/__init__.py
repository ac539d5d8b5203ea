"""The transformer family: GPT-style decoders and BERT-style encoders. Its analytical counts
(`counts`, pure) and its Flax network with Megatron-style tensor parallelism (`network`, JAX).
Import the submodule you need; this package imports nothing."""
