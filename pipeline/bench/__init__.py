"""The benchmarks (``specstream bench ...``): one module per benchmark, and :mod:`.harness`, what they share.

Each benchmark measures its configurations and their baseline in one run and writes its results under an output
directory (``docs/bench`` by default): JSON, and where it has them a markdown table and a plot. Nothing here is on
the path of a request: the CLI imports these modules only when a ``bench`` subcommand runs.
"""
