"""The parts of `python -m bench.kernels`: GPU timing, and one module per kernel family it times."""
