"""Other projects' implementations behind ringbench's variant contract: ring-flash-attn (``rfa``,
with ``rfa_standin`` serving its flash-attn calls), yunchang and PyTorch's context parallel
(``torch_cp``). Each runs as an installed package, never a copy."""
