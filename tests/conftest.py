"""pytest configuration: hypothesis profiles, chosen with FXOPT_HYPOTHESIS_PROFILE.

- ``ci`` (default): reproducible (``derandomize=True``), no deadline (optimize() traces, plans
  and verifies: seconds, not milliseconds), sized to keep tests/test_fuzz.py within its 90 s.
- ``long``: random seeds and many more examples; run by ``benchmarks/fuzz_long.py``.
- ``dev``: a handful of examples, for quick iterations on a property.
"""

import os

from hypothesis import HealthCheck, settings

_SLOW_IS_FINE = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=60,
                          suppress_health_check=_SLOW_IS_FINE, print_blob=True)
settings.register_profile("long", derandomize=False, deadline=None, max_examples=2000,
                          suppress_health_check=_SLOW_IS_FINE, print_blob=True)
settings.register_profile("dev", derandomize=False, deadline=None, max_examples=10,
                          suppress_health_check=_SLOW_IS_FINE, print_blob=True)
settings.load_profile(os.environ.get("FXOPT_HYPOTHESIS_PROFILE", "ci"))
