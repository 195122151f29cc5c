"""What a loaded model holds in memory (the real 0.5B preset in q4): a
cached load hashes its packed network by reading the file, so the mapping's
pages become resident only as the model reads them, and the embedding table
(130 MB of int8 rows, read a few rows a token) stays on disk; where the
weights are read into huge pages, the mapping holds no more than those
rows."""

import os
import subprocess
import sys

import pytest
import torch

from forerun.loading.content_key import file_digest
from forerun.loading.load import resolve_spec
from forerun.loading.packed_cache import FILE_NAME, packed_entry
from forerun.machine import huge_pages

pytestmark = pytest.mark.real_model

CHILD = r"""
import sys
import forerun

def resident_mb(name):
    # The resident pages of the mappings of the file ``name`` (smaps).
    total, current = 0, None
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if len(parts) >= 6 and "-" in parts[0]:
            current = parts[-1]
        elif line.startswith("Rss:") and current == name:
            total += int(parts[1])
    return total / 1024

model = forerun.load("qwen2.5-coder-0.5b", weights="q4", progress=False)
loaded = resident_mb(sys.argv[1])
model.generate("Name a colour.", max_new_tokens=4, draft="none")
print(loaded, resident_mb(sys.argv[1]))
"""


@pytest.mark.parametrize("huge", ["0", "1"])
def test_a_cached_load_leaves_the_embedding_on_disk(huge):
    import forerun

    if huge == "1" and not huge_pages.available():
        pytest.skip("no transparent huge pages here")
    forerun.load("qwen2.5-coder-0.5b", weights="q4", progress=False)     # cached now
    entry = packed_entry(file_digest(resolve_spec("qwen2.5-coder-0.5b")), "q4",
                         torch.device("cpu"))
    network = entry.path / FILE_NAME
    size = network.stat().st_size / 2**20
    out = subprocess.run([sys.executable, "-c", CHILD, str(network.resolve())],
                         capture_output=True, text=True, timeout=600, check=True,
                         env={**os.environ, "FORERUN_HUGE_PAGES": huge})
    loaded, generated = (float(v) for v in out.stdout.split())
    # Hashed through its mapping, the whole network (629 MB) was resident
    # from the load on; now nothing is until the model computes, and the
    # embedding's 130 MB stay out.
    assert loaded < 0.1 * size, (loaded, size)
    if huge == "0":
        assert 0.5 * size < generated < size - 100, (generated, size)
    else:   # the weights are read from their huge pages: the mapping keeps rows read
        assert generated < 0.1 * size, (generated, size)
