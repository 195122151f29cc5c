"""Medusa heads, everything that is theirs: the heads, their file, their
tree drafter and method (``heads``), and their training (``training``)."""
