"""Presentation: run and verify tables (``report``), number and table formats (``formatting``),
the abbreviations of narrow tables (``names``), ``ringbench compare`` (``compare/``), the matrix's
files and picture (``matrix``) and the profile's tables and plots (``profile``). Reads records;
runs nothing."""
