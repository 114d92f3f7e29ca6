# SPDX-License-Identifier: Apache-2.0
"""vllm-hybrid-stack: a patch stack of hybrid-model work on top of pinned vLLM."""

__version__ = "0.1.0"
