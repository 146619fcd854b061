"""Engine integrations: each turns an engine's KV cache into kvtier chunks and back.

Importing this package imports no engine; import the integration you use,
e.g. :mod:`kvtier.integrations.transformers`.
"""
