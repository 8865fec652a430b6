"""Records: the builder every status goes through (``build``), the append-only JSONL store and
its loader (``store``), the environment a record carries (``envinfo``), and reading a record's
case fields (``access``)."""
