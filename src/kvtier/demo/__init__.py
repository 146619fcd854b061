"""``kvtier demo``: kvtier's main job on a real model, in one command.

Builds a small Llama-family model locally (or loads a local checkpoint),
runs a multi-turn chat workload with a long shared system prompt without
kvtier, through kvtier, and from the secondary tiers alone, and reports the
time to first token of each and whether the greedy outputs are identical.
Requires ``pip install 'kvtier[transformers]'``.
"""
