"""The CLI process: building cases (``build``), running a sweep of them (``run``: resume, signals,
records of cases no launch reported), torchrun (``launch``), the results file's lease
(``lease``), the time and memory estimate (``estimate``) and the support matrix's grid
(``matrix``). Nothing here imports torch at load."""
