"""The functional core: pure tensor functions, torch only, no I/O and no config objects."""
