"""The cluster simulation's parts; `python -m bench.cluster_sim` runs it."""
