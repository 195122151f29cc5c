"""This machine: where forerun keeps its files, its measurements, and the CPU's features."""
