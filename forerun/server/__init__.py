"""``forerun serve``: an OpenAI-compatible HTTP server over one loaded model.

The parts, one idea per module:

* :mod:`.schemas`: the request bodies (pydantic models);
* :mod:`.translate`: what a request means for a generation;
* :mod:`.responses`: OpenAI's response and chunk objects;
* :mod:`.errors`: OpenAI-style error bodies and their HTTP statuses;
* :mod:`.worker`: the single engine thread and its bounded FIFO queue;
* :mod:`.prefix_cache`: exact prefix reuse across requests, and saved
  prefixes within a memory budget;
* :mod:`.metrics`: Prometheus metrics;
* :mod:`.app`: the routes (Starlette);
* :mod:`.run`: uvicorn, the listening socket and clean shutdown.

It needs the ``server`` extra (``pip install 'forerun[server]'``): nothing
here is imported by the rest of forerun.
"""

from __future__ import annotations

import importlib.util

INSTALL_HINT = "pip install 'forerun[server]'"
# Import names of the packages the server extra installs.
REQUIRED_MODULES = ("starlette", "uvicorn", "pydantic", "prometheus_client")


def missing_modules() -> list[str]:
    """The server's packages that are not installed (import names)."""
    return [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]
