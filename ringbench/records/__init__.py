"""Records: the builder every status goes through (``build``), the append-only JSONL store and
its loader (``store``), and the environment a record carries (``envinfo``)."""
