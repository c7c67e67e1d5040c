"""Capture of real torch training runs (memory, time) that memsim is validated and calibrated against."""
