# 2026-12-07, fourth session, call 2 (.fa4c carried): the second wheel part put in place, and the flex
# kernel's GPU tests on this card.
mkdir -p /root/fa4 && cp .fa4c/* /root/fa4/
export NO_FA4=1
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-150}
t flex_tests 140 env RINGBENCH_TEST_VARIANTS=1 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_flex.py
tail -5 $L/flex_tests.txt
