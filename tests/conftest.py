import os

# The test-only variants (broken_merge, fault_*, ...) are found only under this variable;
# the CLI's subprocesses and their torchrun workers inherit it.
os.environ["RINGBENCH_TEST_VARIANTS"] = "1"
