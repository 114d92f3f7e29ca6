# SPDX-License-Identifier: Apache-2.0
"""GPU benchmarks of the stack: one script per kernel family (see common.py)."""
