"""Built-in scenario files (``*.toml``), shipped as package data of ringbench."""
