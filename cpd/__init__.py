"""cpd: cache-aware prefill-decode disaggregation."""
__version__ = "0.1.0"
