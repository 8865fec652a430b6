"""Adapters that run ringbench's context-parallel variants inside other libraries' models.

``ringbench.adapters.cp``: sharded inputs, the loss and the gradient all-reduce of a training
step under context parallelism (torch only). ``ringbench.adapters.hf``: the variants as
Hugging Face transformers attention implementations (needs transformers: ``pip install -e '.[hf]'`` in the checkout).
Both sit on the harness side: they use ``ringbench.variants`` through its registry only.
"""
