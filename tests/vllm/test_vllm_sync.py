"""Weight sync end to end against the vLLM engine server, per transport (disk, broadcast, ipc).

Every test of the transformers engine's sync suite (tests/integration/test_sync_transports.py) is
collected here too, where `engine`, `models` and `reference` resolve to tests/vllm/conftest.py's
fixtures: the shared vLLM server and HF's greedy tokens. The same assertions thus hold for both
engines, and a test added there runs against vLLM without an edit here: the update lands and VERIFY
passes, every request during a sync comes from exactly one version, and a tensor corrupted in flight
is caught by VERIFY and never served.
"""

from __future__ import annotations

import test_sync_transports as _hf_suite

# Only the test functions: the suite's own fixtures (engine, models, reference) must not shadow ours.
globals().update({name: test for name, test in vars(_hf_suite).items() if name.startswith("test_")})
