"""Speed and memory features shared by the models and the trainer (see docs/ARCHITECTURE.md).

The hardware policy (``runtime/policy.py``) runs the linear formats' self-tests by name; importing them here, the
package's composition root, registers them whatever part of the package is imported first.
"""
from .nvfp4 import selftest as nvfp4_selftest  # noqa: F401 - registers the "nvfp4" and "fp8" self-tests
