"""Corpora of token ids and local text: the token manifests that training
data accumulates in, the local text files it reads, and token frequencies."""
