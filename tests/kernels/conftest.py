"""Shared configuration for the kernel tests.

Hypothesis runs deterministically under the "ci" profile (the default) so
that CI results are reproducible; select "dev" with HYPOTHESIS_PROFILE=dev
for a broader local search.
"""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, deadline=None, max_examples=5)
settings.register_profile("dev", deadline=None, max_examples=50)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
