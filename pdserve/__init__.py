"""pdserve: disaggregated prefill/decode serving on stock vLLM.

The subpackages live in the repository's top-level folders (router/, kvstore/, ...)
and are mapped under this namespace by pyproject.toml.
"""

__version__ = "0.1.0"
