"""The algorithms under test: the ring engine and its plans (ring, zigzag, stripe, their varlen
forms), the all-gather engines (llama3), the all-to-all ones (ulysses, usp over ``grid``), and
what they share: merge (and its Triton form), layouts, balanced, varlen, bands, window, masks (the
torch-free slices of any mask), mask_balance (chunks given to ranks to even any mask's work) and
masked (a mask's blocks in the engines), sinks and the counted communicators (``comm``)."""
