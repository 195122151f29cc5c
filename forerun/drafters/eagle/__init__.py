"""EAGLE-3 heads, everything that is theirs: the weights and their file
layout (``weights``, ``files``: the layout vLLM and SGLang load), the head
that runs on the target's layer states (``head``), the drafter and its
methods (``drafter``), and their training (``trainable``, ``features``,
``training``)."""
