"""Inside a torchrun rank: the worker, a case's set-up, timing (``bench``), verify's checks
(``check``, ``sink_pad``), the model check, the profile's spans, emulation, the peaks table and
the rank's lifeline to torchrun."""
